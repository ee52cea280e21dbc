// The loss scale of mixed-precision training, kept on the device and updated
// there (no host round trip), so that a whole step can be captured in a CUDA
// graph. With hysteresis 1 it makes exactly PyTorch GradScaler's decisions.
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include "gradkit/core/memory.h"

namespace gradkit {

enum class LossScaling {
  dynamic,  // back off on overflow, grow after growth_interval clean steps
  fixed,    // S stays initial_scale (steps with overflow are still skipped)
  none,     // S = 1 (bf16 training): only the overflow check and the skip remain
};

struct LossScalerOptions {
  LossScaling mode = LossScaling::dynamic;
  float initial_scale = 65536.0f;  // PyTorch's defaults
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int32_t growth_interval = 2000;
  // DeepSpeed's hysteresis: the scale backs off on an overflow only once
  // `hysteresis` overflows have been seen since it last grew (1: every time).
  int32_t hysteresis = 1;
  float min_scale = 0.0f;
  float max_scale = std::numeric_limits<float>::infinity();
};

// The scaler's state as it lies in device memory.
struct LossScalerState {
  float scale;
  int32_t growth_tracker;      // clean steps since the last change
  int32_t hysteresis_left;     // overflows still tolerated before backing off
};

class LossScaler {
 public:
  LossScaler() = default;
  // Validates the options (factors, interval, hysteresis, bounds) with
  // errors naming the field; allocates the state on `device`.
  LossScaler(Device device, LossScalerOptions options = {});

  // The current S, a float on the device (the loss is multiplied by it).
  const float* scale_device() const { return &state_device()->scale; }
  // After the step: the decision, from the found-inf flag on the device.
  void update(const bool* found_inf, Stream stream = {});

  LossScalerState state() const;  // synchronous read
  void set_state(const LossScalerState& state);  // synchronous write; validated
  void check_state(const LossScalerState& state) const;  // throws invalid_argument naming the field
  const LossScalerOptions& options() const { return options_; }
  Device device() const { return state_.device(); }

 private:
  void require_state(std::string_view call) const;
  LossScalerState* state_device() const { return static_cast<LossScalerState*>(state_.data()); }
  LossScalerOptions options_;
  Buffer state_;
};

}  // namespace gradkit
