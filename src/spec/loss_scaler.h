// The loss scaler's decision, written once for both backends.
#pragma once

#include "spec/adam_math.h"  // GRADKIT_HD
#include "gradkit/optim/loss_scaler.h"

namespace gradkit::spec {

GRADKIT_HD void update_loss_scale(LossScalerState& s, bool found_inf, const LossScalerOptions& o) {
  if (o.mode != LossScaling::dynamic) return;
  if (found_inf) {
    s.growth_tracker = 0;
    if (s.hysteresis_left <= 1) {
      const float backed_off = s.scale * o.backoff_factor;
      s.scale = backed_off > o.min_scale ? backed_off : o.min_scale;
    } else {
      --s.hysteresis_left;
    }
    return;
  }
  if (++s.growth_tracker == o.growth_interval) {
    const float grown = s.scale * o.growth_factor;
    if (grown - grown == 0.0f) s.scale = grown < o.max_scale ? grown : o.max_scale;  // finite: grow
    s.growth_tracker = 0;
    s.hysteresis_left = o.hysteresis;
  }
}

void update_loss_scale_cuda(LossScalerState* state, const bool* found_inf, const LossScalerOptions& options,
                            Device device, Stream stream);

}  // namespace gradkit::spec
