#include "gradkit/optim/loss_scaler.h"

#include <cmath>
#include <string>

#include "backend/loss_scaler.h"
#include "gradkit/core/error.h"
#include "ops/device_scalar.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "LossScaler";

void check(bool ok, const std::string& arg, const std::string& what, double value) {
  if (!ok) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, arg, "is " + std::to_string(value) + ", expected " + what);
  }
}

}  // namespace

LossScaler::LossScaler(Device device, LossScalerOptions o) : options_(o) {
  if (o.mode == LossScaling::none) options_.initial_scale = 1.0f;
  const float s = options_.initial_scale;
  check(std::isfinite(s) && s > 0, "options.initial_scale", "a finite value > 0", s);
  check(std::isfinite(o.growth_factor) && o.growth_factor > 1, "options.growth_factor", "a finite value > 1",
        o.growth_factor);
  check(o.backoff_factor > 0 && o.backoff_factor < 1, "options.backoff_factor", "a value in (0, 1)", o.backoff_factor);
  check(o.growth_interval >= 1, "options.growth_interval", "an integer >= 1", o.growth_interval);
  check(o.hysteresis >= 1, "options.hysteresis", "an integer >= 1", o.hysteresis);
  check(std::isfinite(o.min_scale) && o.min_scale >= 0, "options.min_scale", "a finite value >= 0", o.min_scale);
  check(!std::isnan(o.max_scale) && o.max_scale >= o.min_scale && o.max_scale > 0, "options.max_scale",
        "a value > 0 and >= min_scale", o.max_scale);
  state_ = Buffer(device, sizeof(LossScalerState));
  set_state({s, 0, o.hysteresis});
}

void LossScaler::update(const bool* found_inf, Stream stream) {
  ops::check_device_scalar(kOp, "found_inf", found_inf, state_.device(), false);
  if (state_.device().is_cuda()) {
    backend::update_loss_scale_cuda(state_device(), found_inf, options_, state_.device(), stream);
  } else {
    backend::update_loss_scale(*state_device(), *found_inf, options_);
  }
}

LossScalerState LossScaler::state() const {
  LossScalerState s{};
  copy_to_host(&s, state_.data(), sizeof s, state_.device());
  return s;
}

void LossScaler::set_state(const LossScalerState& s) {
  check_state(s);
  copy_from_host(state_.data(), state_.device(), &s, sizeof s);
}

void LossScaler::check_state(const LossScalerState& s) const {
  check(std::isfinite(s.scale) && s.scale > 0, "state.scale", "a finite value > 0", s.scale);
  check(s.growth_tracker >= 0 && s.growth_tracker < options_.growth_interval, "state.growth_tracker",
        "an integer in [0, growth_interval)", s.growth_tracker);
  check(s.hysteresis_left >= 1 && s.hysteresis_left <= options_.hysteresis, "state.hysteresis_left",
        "an integer in [1, hysteresis]", s.hysteresis_left);
}

}  // namespace gradkit
