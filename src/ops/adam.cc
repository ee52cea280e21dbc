// Public Adam entry points: validate every input, then dispatch the plan.
#include "gradkit/ops/adam.h"

#include <cmath>
#include <string>

#include "backend/adam.h"
#include "backend/cuda_runtime.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "ops/device_scalar.h"
#include "ops/optimizer_dtypes.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "adam_step";


}  // namespace

void validate(const AdamHyperparameters& h, std::string_view op, const std::string& arg) {
  (void)op;
  check_value(std::isfinite(h.lr) && h.lr >= 0, kOp, arg + ".lr", h.lr, "a finite value >= 0");
  check_value(h.beta1 >= 0 && h.beta1 < 1, kOp, arg + ".beta1", h.beta1, "a value in [0, 1)");
  check_value(h.beta2 >= 0 && h.beta2 < 1, kOp, arg + ".beta2", h.beta2, "a value in [0, 1)");
  check_value(std::isfinite(h.eps) && h.eps > 0, kOp, arg + ".eps", h.eps, "a finite value > 0");
  check_value(std::isfinite(h.weight_decay) && h.weight_decay >= 0, kOp, arg + ".weight_decay", h.weight_decay, "a finite value >= 0");
  const auto decay = static_cast<int32_t>(h.decay);
  check_value(decay >= 0 && decay <= 2, kOp, arg + ".decay", decay, "l2, decoupled or hugging_face");
}

AdamPlan::AdamPlan(const AdamTensors& t, std::span<const AdamHyperparameters> hyperparameters,
                   std::span<const int32_t> groups) {
  if (hyperparameters.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "hyperparameters", "is empty; expected one entry per group");
  }
  bool any_amsgrad = false;
  for (size_t i = 0; i < hyperparameters.size(); ++i) {
    validate(hyperparameters[i], kOp, "hyperparameters[" + std::to_string(i) + "]");
    any_amsgrad = any_amsgrad || hyperparameters[i].amsgrad;
  }
  if (any_amsgrad && t.max_exp_avg_sq.size() != t.weights.size()) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, "max_exp_avg_sq",
                         "has " + std::to_string(t.max_exp_avg_sq.size()) + " tensors, expected " +
                             std::to_string(t.weights.size()) + " (a group uses amsgrad)");
  }
  std::vector<PlanList> lists = {{"weights", t.weights, true},
                                 {"grads", t.grads, false},
                                 {"exp_avg", t.exp_avg, true},
                                 {"exp_avg_sq", t.exp_avg_sq, true}};
  int max_list = -1, copy_list = -1;
  if (any_amsgrad) {
    max_list = static_cast<int>(lists.size());
    lists.push_back({"max_exp_avg_sq", t.max_exp_avg_sq, true});
  }
  if (!t.model_copy.empty()) {
    copy_list = static_cast<int>(lists.size());
    lists.push_back({"model_copy", t.model_copy, true});
  }
  plan_ = MultiTensorPlan(kOp, lists, MultiTensorPlan::kDefaultChunkElements, groups,
                          static_cast<int32_t>(hyperparameters.size()));
  ops::check_optimizer_dtypes(kOp, plan_, {.max_exp_avg_sq = max_list, .model_copy = copy_list});
  has_max_ = max_list >= 0;
  has_copy_ = copy_list >= 0;
  set_hyperparameters(hyperparameters);
}

void AdamPlan::set_hyperparameters(std::span<const AdamHyperparameters> hyperparameters) {
  for (size_t i = 0; i < hyperparameters.size(); ++i) {
    if (hyperparameters[i].amsgrad && !has_max_ && !hyper_.empty()) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, "hyperparameters[" + std::to_string(i) + "].amsgrad",
                           "is true, but the plan was made without max_exp_avg_sq");
    }
  }
  hyper_.set(kOp, hyperparameters, plan_.device());
}

void AdamPlan::validate_inputs(const AdamStepInputs& in) const {
  const Device device = plan_.device();
  if (in.step_device == nullptr && in.step < 1) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "step", "is " + std::to_string(in.step) + ", expected >= 1");
  }
  check_value(in.grad_scale_device != nullptr || (std::isfinite(in.grad_scale) && in.grad_scale > 0), kOp,
              "grad_scale", in.grad_scale, "a finite value > 0");
  ops::check_device_scalar(kOp, "step_device", in.step_device, device);
  ops::check_device_scalar(kOp, "lr_device", in.lr_device, device);
  ops::check_device_scalar(kOp, "grad_scale_device", in.grad_scale_device, device);
  ops::check_device_scalar(kOp, "found_inf", in.found_inf, device);
}

void AdamPlan::step(const AdamStepInputs& in, Stream stream) const {
  validate_inputs(in);
  const Device device = plan_.device();
  if (plan_.empty()) return;

  backend::AdamLaunch launch;
  launch.inputs = in;
  launch.max_list = has_max_ ? 4 : -1;
  launch.copy_list = has_copy_ ? (has_max_ ? 5 : 4) : -1;
  launch.groups = hyper_.on(device);
  if (device.is_cuda()) backend::adam_cuda(plan_, launch, stream);
  else backend::adam_cpu(plan_, launch);
}

void adam_step(const AdamTensors& tensors, const AdamHyperparameters& hyperparameters, const AdamStepInputs& inputs,
               Stream stream) {
  AdamPlan(tensors, std::span(&hyperparameters, 1)).step(inputs, stream);
}

}  // namespace gradkit
