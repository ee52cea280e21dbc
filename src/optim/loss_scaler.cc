#include "gradkit/optim/loss_scaler.h"

#include <cmath>
#include <string>

#include "spec/loss_scaler.h"
#include "gradkit/core/error.h"
#include "ops/device_scalar.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "LossScaler";


}  // namespace

LossScaler::LossScaler(Device device, LossScalerOptions o) : options_(o) {
  if (o.mode == LossScaling::none) options_.initial_scale = 1.0f;
  const float s = options_.initial_scale;
  check_value(std::isfinite(s) && s > 0, kOp, "options.initial_scale", s, "a finite value > 0");
  check_value(std::isfinite(o.growth_factor) && o.growth_factor > 1, kOp, "options.growth_factor", o.growth_factor, "a finite value > 1");
  check_value(o.backoff_factor > 0 && o.backoff_factor < 1, kOp, "options.backoff_factor", o.backoff_factor, "a value in (0, 1)");
  check_value(o.growth_interval >= 1, kOp, "options.growth_interval", o.growth_interval, "an integer >= 1");
  check_value(o.hysteresis >= 1, kOp, "options.hysteresis", o.hysteresis, "an integer >= 1");
  check_value(std::isfinite(o.min_scale) && o.min_scale >= 0, kOp, "options.min_scale", o.min_scale, "a finite value >= 0");
  check_value(!std::isnan(o.max_scale) && o.max_scale >= o.min_scale && o.max_scale > 0, kOp, "options.max_scale", o.max_scale, "a value > 0 and >= min_scale");
  state_ = Buffer(device, sizeof(LossScalerState));
  set_state({s, 0, o.hysteresis});
}

void LossScaler::update(const bool* found_inf, Stream stream) {
  require_state("update");
  ops::check_device_scalar(kOp, "found_inf", found_inf, state_.device(), false);
  if (state_.device().is_cuda()) {
    spec::update_loss_scale_cuda(state_device(), found_inf, options_, state_.device(), stream);
  } else {
    spec::update_loss_scale(*state_device(), *found_inf, options_);
  }
}

void LossScaler::require_state(std::string_view call) const {
  if (state_.data() == nullptr) {
    throw Error(ErrorCode::invalid_argument, std::string(kOp) + "::" + std::string(call) +
                                                 ": this scaler was default-constructed; construct it with a device");
  }
}

LossScalerState LossScaler::state() const {
  require_state("state");
  LossScalerState s{};
  copy_to_host(&s, state_.data(), sizeof s, state_.device());
  return s;
}

void LossScaler::set_state(const LossScalerState& s) {
  require_state("set_state");
  check_state(s);
  copy_from_host(state_.data(), state_.device(), &s, sizeof s);
}

void LossScaler::check_state(const LossScalerState& s) const {
  check_value(std::isfinite(s.scale) && s.scale > 0, kOp, "state.scale", s.scale, "a finite value > 0");
  check_value(s.growth_tracker >= 0 && s.growth_tracker < options_.growth_interval, kOp, "state.growth_tracker", s.growth_tracker, "an integer in [0, growth_interval)");
  check_value(s.hysteresis_left >= 1 && s.hysteresis_left <= options_.hysteresis, kOp, "state.hysteresis_left", s.hysteresis_left, "an integer in [1, hysteresis]");
}

}  // namespace gradkit
