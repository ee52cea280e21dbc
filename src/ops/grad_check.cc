#include "gradkit/ops/grad_check.h"

#include <cmath>
#include <string>

#include "spec/grad_check.h"
#include "gradkit/core/error.h"
#include "ops/device_scalar.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "check_gradients";

}  // namespace

GradientCheckPlan::GradientCheckPlan(std::span<const TensorView> grads, GradientCheckOptions options)
    : options_(options) {
  check_value(std::isfinite(options.max_norm) && options.max_norm >= 0, kOp, "options.max_norm", options.max_norm,
              "a finite value >= 0 (0: no clipping)");
  if (options.norm != NormType::l2 && options.norm != NormType::infinity) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "options.norm", "is not l2 or infinity");
  }
  const PlanList lists[] = {{"grads", grads, options.write_unscaled}};
  plan_ = MultiTensorPlan(kOp, lists);
  if (plan_.num_tensors() > 0 && plan_.dtype(0) == DType::f64) {
    throw_argument_error(ErrorCode::dtype_unsupported, kOp, "grads", "has dtype f64, expected f32, f16 or bf16");
  }
  const size_t chunks = plan_.chunks().size();
  scratch_ = Buffer(plan_.num_tensors() > 0 ? plan_.device() : Device::cpu(), chunks * (sizeof(double) + sizeof(bool)) + 1);
}

namespace {

void check_outputs(std::string_view op, const GradientCheckOutputs& out, float loss_scale,
                   const float* loss_scale_device, Device device) {
  check_value(loss_scale_device != nullptr || (std::isfinite(loss_scale) && loss_scale > 0), op, "loss_scale",
              loss_scale, "a finite value > 0");
  ops::check_device_scalar(op, "loss_scale_device", loss_scale_device, device);
  ops::check_device_scalar(op, "found_inf", out.found_inf, device);
  ops::check_device_scalar(op, "grad_divisor", out.grad_divisor, device);
  ops::check_device_scalar(op, "global_norm", out.global_norm, device);
  ops::check_device_scalar(op, "tensor_norms", out.tensor_norms, device);
  ops::check_device_scalar(op, "partial", out.partial, device);
}

}  // namespace

void GradientCheckPlan::check(const GradientCheckOutputs& out, float loss_scale, const float* loss_scale_device,
                              Stream stream) const {
  const Device device = plan_.num_tensors() > 0 ? plan_.device() : Device::cpu();
  check_outputs(kOp, out, loss_scale, loss_scale_device, device);

  spec::GradCheckLaunch launch;
  launch.options = options_;
  launch.outputs = out;
  launch.loss_scale = loss_scale;
  launch.loss_scale_device = loss_scale_device;
  launch.partial_norms = static_cast<double*>(scratch_.data());
  launch.partial_flags = reinterpret_cast<bool*>(launch.partial_norms + plan_.chunks().size());
  if (device.is_cuda()) spec::grad_check_cuda(plan_, launch, stream);
  else spec::grad_check_cpu(plan_, launch);
}

void GradientCheckPlan::combine(const double* partials, int count, const GradientCheckOutputs& out, float loss_scale,
                                const float* loss_scale_device, Stream stream) const {
  constexpr std::string_view op = "check_gradients.combine";
  const Device device = plan_.num_tensors() > 0 ? plan_.device() : Device::cpu();
  check_outputs(op, out, loss_scale, loss_scale_device, device);
  if (count < 1) throw_argument_error(ErrorCode::invalid_argument, op, "count", "is " + std::to_string(count) + ", expected >= 1");
  ops::check_device_scalar(op, "partials", partials, device, /*optional=*/false);
  if (out.tensor_norms != nullptr || out.partial != nullptr) {
    throw_argument_error(ErrorCode::invalid_argument, op, out.tensor_norms != nullptr ? "tensor_norms" : "partial",
                         "is given, expected null (combine writes the global results only)");
  }
  spec::GradCheckLaunch launch;
  launch.options = options_;
  launch.outputs = out;
  launch.loss_scale = loss_scale;
  launch.loss_scale_device = loss_scale_device;
  if (device.is_cuda()) spec::grad_check_combine_cuda(device, partials, count, launch, stream);
  else spec::grad_check_combine_cpu(partials, count, launch);
}

}  // namespace gradkit
