// Public LAMB entry points: validate every input, then run the two passes.
#include "gradkit/ops/lamb.h"

#include <cmath>
#include <string>

#include "spec/cuda_runtime.h"
#include "spec/lamb.h"
#include "spec/low_bit_tables.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "ops/device_scalar.h"
#include "ops/optimizer_dtypes.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "lamb_step";

}  // namespace

void validate(const LambHyperparameters& h, std::string_view op, const std::string& arg) {
  check_value(h.alpha >= 0 && h.alpha < 1, op, arg + ".alpha", h.alpha, "a value in [0, 1)");
  check_value(h.beta >= 0 && h.beta < 1, op, arg + ".beta", h.beta, "a value in [0, 1)");
  check_value(std::isfinite(h.lambda) && h.lambda >= 0, op, arg + ".lambda", h.lambda, "a finite value >= 0");
  check_value(std::isfinite(h.epsilon) && h.epsilon > 0, op, arg + ".epsilon", h.epsilon, "a finite value > 0");
  check_value(!std::isnan(h.ratio_min), op, arg + ".ratio_min", h.ratio_min, "a number (not NaN)");
  check_value(!std::isnan(h.ratio_max) && h.ratio_max >= h.ratio_min, op, arg + ".ratio_max", h.ratio_max, "a number >= ratio_min");
  check_value(std::isfinite(h.max_norm), op, arg + ".max_norm", h.max_norm, "a finite value (<= 0 turns clipping off)");
}

LambPlan::LambPlan(const LambTensors& t, std::span<const LambHyperparameters> hyperparameters,
                   std::span<const int32_t> groups) {
  if (hyperparameters.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "hyperparameters", "is empty; expected one entry per group");
  }
  for (size_t i = 0; i < hyperparameters.size(); ++i) {
    validate(hyperparameters[i], kOp, "hyperparameters[" + std::to_string(i) + "]");
  }
  if (!t.model_copy.empty() && !t.update.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "model_copy",
                         "is given with 'update'; expected one of them (the weights are not written when the "
                         "update is returned)");
  }
  const bool quantized = !t.exp_avg.empty() && t.exp_avg[0].dtype == DType::u8;
  if (quantized && !t.weight_remainder.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "weight_remainder",
                         "is given with 8- or 4-bit moments (exp_avg u8); expected f32 or bf16 moments with "
                         "weight_remainder (LAMB's remainder master takes float moments only)");
  }
  ops::check_moment_bits(kOp, t.moment_bits, quantized);
  ops::check_absmax_lists(kOp, t.weights.size(), t.exp_avg_absmax.size(), t.exp_avg_sq_absmax.size(), quantized);
  // 4-bit moments hold two codes a byte: one element per 2 (PlanList::block).
  const int32_t bits = quantized ? t.moment_bits : 8;
  const int32_t codes_per_element = elements_per_code_byte(bits);
  std::vector<PlanList> lists = {{"weights", t.weights, true},
                                 {"grads", t.grads, false},
                                 {"exp_avg", t.exp_avg, true, codes_per_element, true},
                                 {"exp_avg_sq", t.exp_avg_sq, true, codes_per_element, true}};
  if (!t.model_copy.empty()) {
    copy_list_ = static_cast<int>(lists.size());
    lists.push_back({"model_copy", t.model_copy, true});
  }
  if (!t.update.empty()) {
    update_list_ = static_cast<int>(lists.size());
    lists.push_back({"update", t.update, true});
  }
  if (quantized) {
    absmax_list_ = static_cast<int>(lists.size());
    lists.push_back({"exp_avg_absmax", t.exp_avg_absmax, true, quant_block_of(bits)});
    lists.push_back({"exp_avg_sq_absmax", t.exp_avg_sq_absmax, true, quant_block_of(bits)});
  }
  if (!t.weight_remainder.empty()) {
    remainder_list_ = static_cast<int>(lists.size());
    lists.push_back({"weight_remainder", t.weight_remainder, true, 1, true});
  }
  plan_ = MultiTensorPlan(kOp, lists, MultiTensorPlan::kDefaultChunkElements, groups,
                          static_cast<int32_t>(hyperparameters.size()));
  ops::check_optimizer_dtypes(kOp, plan_,
                              {.model_copy = copy_list_,
                               .update = update_list_,
                               .weight_remainder = remainder_list_,
                               .u8_moments = true});
  moment_bits_ = quantized ? bits : 0;
  if (quantized && plan_.device().is_cuda()) {
    tables_ = bits == 4 ? spec::upload(plan_.device(), &spec::quant_tables4(), sizeof(spec::QuantTables4))
                        : spec::upload(plan_.device(), &spec::quant_tables(), sizeof(spec::QuantTables));
  }
  scratch_ = Buffer(plan_.device(), (2 * sizeof(double)) * plan_.chunks().size() + sizeof(float) * plan_.num_tensors());
  set_hyperparameters(hyperparameters);
}

void LambPlan::set_hyperparameters(std::span<const LambHyperparameters> hyperparameters) {
  hyper_.set(kOp, hyperparameters, plan_.device());
}

void validate_eta(float eta, std::string_view op, std::string_view arg) {
  check_value(std::isfinite(eta) && eta >= 0, op, arg, eta, "a finite value >= 0");
}

void LambPlan::validate_inputs(const LambStepInputs& in) const {
  const Device device = plan_.device();
  if (in.eta_device == nullptr) validate_eta(in.eta, kOp, "eta");
  if (in.loss_scale_device == nullptr) {
    check_value(std::isfinite(in.loss_scale) && in.loss_scale > 0, kOp, "loss_scale", in.loss_scale, "a finite value > 0");
  }
  if (in.gradient_norm_device == nullptr) {
    check_value(!std::isnan(in.gradient_norm) && in.gradient_norm < INFINITY, kOp, "gradient_norm", in.gradient_norm,
                "a finite norm >= 0, or < 0 for none");
  }
  if (in.step_device == nullptr) check_value(in.step >= 1, kOp, "step", static_cast<double>(in.step), "a count >= 1");
  ops::check_device_scalar(kOp, "eta_device", in.eta_device, device);
  ops::check_device_scalar(kOp, "loss_scale_device", in.loss_scale_device, device);
  ops::check_device_scalar(kOp, "gradient_norm_device", in.gradient_norm_device, device);
  ops::check_device_scalar(kOp, "step_device", in.step_device, device);
  ops::check_device_scalar(kOp, "found_inf", in.found_inf, device);
  if (in.do_update.where == Flag::Where::device) {
    ops::check_device_scalar(kOp, "do_update", in.do_update.pointer, device, false);
  }
  const LambSplit& split = in.split;
  if (split.pass != LambPass::both && split.pass != LambPass::first && split.pass != LambPass::second) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "split.pass", "is not both, first or second");
  }
  if (split.pass != LambPass::both) {
    ops::check_device_scalar(kOp, "split.sums", split.sums, device, /*optional=*/false);
    ops::check_device_scalar(kOp, "split.index", split.index, device, /*optional=*/false);
    check_value(split.rows >= 1, kOp, "split.rows", split.rows, "a count >= 1");
    check_value(split.row_stride >= 0, kOp, "split.row_stride", static_cast<double>(split.row_stride), "a stride >= 0");
  }
}

void LambPlan::step(const LambStepInputs& in, Stream stream) const {
  validate_inputs(in);
  if (in.do_update.where == Flag::Where::host && !in.do_update.host_value) return;  // nothing written, step kept
  spec::LambLaunch launch;
  launch.inputs = in;
  launch.do_update = in.do_update.where == Flag::Where::device ? in.do_update.pointer : nullptr;
  launch.partials = static_cast<double*>(scratch_.data());
  launch.ratios = reinterpret_cast<float*>(launch.partials + 2 * plan_.chunks().size());
  launch.copy_list = copy_list_;
  launch.update_list = update_list_;
  launch.absmax_list = absmax_list_;
  launch.remainder_list = remainder_list_;
  launch.moment_bits = moment_bits_;
  const bool cuda = plan_.device().is_cuda();
  if (moment_bits_ == 4) {
    launch.tables4 = cuda ? static_cast<const spec::QuantTables4*>(tables_.get()) : &spec::quant_tables4();
  } else {
    launch.tables = cuda ? static_cast<const spec::QuantTables*>(tables_.get()) : &spec::quant_tables();
  }
  launch.groups = hyper_.on(plan_.device());
  if (plan_.device().is_cuda()) spec::lamb_cuda(plan_, launch, stream);
  else spec::lamb_cpu(plan_, launch);
}

void lamb_step(const LambTensors& tensors, const LambHyperparameters& hyperparameters, const LambStepInputs& inputs,
               Stream stream) {
  LambPlan(tensors, std::span(&hyperparameters, 1)).step(inputs, stream);
}

}  // namespace gradkit
