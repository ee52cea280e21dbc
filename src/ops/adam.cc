// Public Adam entry points: validate every input, then dispatch the plan.
#include "gradkit/ops/adam.h"

#include <cmath>
#include <string>

#include "spec/adam.h"
#include "spec/cuda_runtime.h"
#include "spec/low_bit_tables.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "ops/device_scalar.h"
#include "ops/optimizer_dtypes.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "adam_step";

// What 8- and 4-bit moments rule out (the lists they need: check_absmax_lists).
void check_quantized_lists(const AdamTensors& t, std::span<const AdamHyperparameters> hyperparameters,
                           bool quantized) {
  ops::check_moment_bits(kOp, t.moment_bits, quantized);
  ops::check_absmax_lists(kOp, t.weights.size(), t.exp_avg_absmax.size(), t.exp_avg_sq_absmax.size(), quantized);
  if (!quantized) return;
  for (size_t i = 0; i < hyperparameters.size(); ++i) {
    if (hyperparameters[i].amsgrad) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, "hyperparameters[" + std::to_string(i) + "].amsgrad",
                           "is true with " + std::to_string(t.moment_bits) +
                               "-bit moments (exp_avg u8); expected false");
    }
  }
}

}  // namespace

void validate(const AdamHyperparameters& h, std::string_view op, const std::string& arg) {
  check_value(std::isfinite(h.lr) && h.lr >= 0, op, arg + ".lr", h.lr, "a finite value >= 0");
  check_value(h.beta1 >= 0 && h.beta1 < 1, op, arg + ".beta1", h.beta1, "a value in [0, 1)");
  check_value(h.beta2 >= 0 && h.beta2 < 1, op, arg + ".beta2", h.beta2, "a value in [0, 1)");
  check_value(std::isfinite(h.eps) && h.eps > 0, op, arg + ".eps", h.eps, "a finite value > 0");
  check_value(std::isfinite(h.weight_decay) && h.weight_decay >= 0, op, arg + ".weight_decay", h.weight_decay, "a finite value >= 0");
  const auto decay = static_cast<int32_t>(h.decay);
  check_value(decay >= 0 && decay <= 2, op, arg + ".decay", decay, "l2, decoupled or hugging_face");
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
  const bool quantized = !t.exp_avg.empty() && t.exp_avg[0].dtype == DType::u8;
  check_quantized_lists(t, hyperparameters, quantized);
  // Every list of encoded state is a storage list; the dtype rules below say
  // which storage dtype each may hold.
  // 4-bit moments hold two codes a byte: one element per 2 (PlanList::block).
  const bool four_bit = quantized && t.moment_bits == 4;
  const int32_t bits = four_bit ? 4 : 8;
  const int32_t codes_per_element = elements_per_code_byte(bits), absmax_block = quant_block_of(bits);
  std::vector<PlanList> lists = {{"weights", t.weights, true},
                                 {"grads", t.grads, false},
                                 {"exp_avg", t.exp_avg, true, codes_per_element, true},
                                 {"exp_avg_sq", t.exp_avg_sq, true, codes_per_element, true}};
  Lists at;
  auto add = [&](int& index, PlanList list) {
    index = static_cast<int>(lists.size());
    lists.push_back(list);
  };
  if (any_amsgrad) add(at.max_exp_avg_sq, {"max_exp_avg_sq", t.max_exp_avg_sq, true});
  if (!t.model_copy.empty()) add(at.model_copy, {"model_copy", t.model_copy, true});
  if (quantized) {
    add(at.absmax, {"exp_avg_absmax", t.exp_avg_absmax, true, absmax_block});
    lists.push_back({"exp_avg_sq_absmax", t.exp_avg_sq_absmax, true, absmax_block});
  }
  if (!t.weight_remainder.empty()) add(at.remainder, {"weight_remainder", t.weight_remainder, true, 1, true});
  plan_ = MultiTensorPlan(kOp, lists, MultiTensorPlan::kDefaultChunkElements, groups,
                          static_cast<int32_t>(hyperparameters.size()));
  ops::check_optimizer_dtypes(kOp, plan_,
                              {.max_exp_avg_sq = at.max_exp_avg_sq,
                               .model_copy = at.model_copy,
                               .weight_remainder = at.remainder,
                               .u8_moments = true});
  lists_ = at;
  moment_bits_ = quantized ? t.moment_bits : 0;
  if (quantized && plan_.device().is_cuda()) {
    tables_ = four_bit ? spec::upload(plan_.device(), &spec::quant_tables4(), sizeof(spec::QuantTables4))
                       : spec::upload(plan_.device(), &spec::quant_tables(), sizeof(spec::QuantTables));
  }
  set_hyperparameters(hyperparameters);
}

void AdamPlan::set_hyperparameters(std::span<const AdamHyperparameters> hyperparameters) {
  for (size_t i = 0; i < hyperparameters.size(); ++i) {
    if (hyperparameters[i].amsgrad && lists_.max_exp_avg_sq < 0 && !hyper_.empty()) {
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

  spec::AdamLaunch launch;
  launch.inputs = in;
  launch.max_list = lists_.max_exp_avg_sq;
  launch.copy_list = lists_.model_copy;
  launch.absmax_list = lists_.absmax;
  launch.remainder_list = lists_.remainder;
  launch.moment_bits = moment_bits_;
  if (moment_bits_ == 4) {
    launch.tables4 =
        device.is_cuda() ? static_cast<const spec::QuantTables4*>(tables_.get()) : &spec::quant_tables4();
  } else {
    launch.tables =
        device.is_cuda() ? static_cast<const spec::QuantTables*>(tables_.get()) : &spec::quant_tables();
  }
  launch.groups = hyper_.on(device);
  if (device.is_cuda()) spec::adam_cuda(plan_, launch, stream);
  else spec::adam_cpu(plan_, launch);
}

void adam_step(const AdamTensors& tensors, const AdamHyperparameters& hyperparameters, const AdamStepInputs& inputs,
               Stream stream) {
  AdamPlan(tensors, std::span(&hyperparameters, 1)).step(inputs, stream);
}

}  // namespace gradkit
