// Public gradient-control entry points: validate everything, then hand the
// plan to the backend of its device.
#include "gradkit/ops/gradient.h"

#include <algorithm>
#include <array>
#include <string>

#include "spec/cuda_runtime.h"
#include "spec/gradient.h"
#include "gradkit/core/error.h"
#include "ops/device_scalar.h"

namespace gradkit {
namespace {

constexpr std::array<DTypePair, 10> kAccumulatePairs = {{
    {DType::f32, DType::f32},   {DType::f32, DType::f16},   {DType::f32, DType::bf16},
    {DType::f16, DType::f16},   {DType::f16, DType::f32},   {DType::f16, DType::bf16},
    {DType::bf16, DType::bf16}, {DType::bf16, DType::f32},  {DType::bf16, DType::f16},
    {DType::f64, DType::f64},
}};

void check_accumulate_dtypes(std::string_view op, const MultiTensorPlan& plan) {
  if (plan.num_tensors() == 0) return;
  const DTypePair pair{plan.dtype(0), plan.dtype(1)};
  if (!is_accumulate_pair(pair)) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, "values",
                         "has dtype " + std::string(dtype_name(pair.second)) + " with buffers of dtype " +
                             std::string(dtype_name(pair.first)) +
                             "; expected any pair of f32/f16/bf16, or f64 with f64");
  }
}

// A flag read by the operation: a host flag is read now; a device flag must
// live on the plan's device (for the CPU backend: in host memory).
const bool* flag_pointer(std::string_view op, std::string_view arg, const Flag& flag, Device device) {
  if (flag.where != Flag::Where::device) return nullptr;
  ops::check_device_scalar(op, arg, flag.pointer, device, false);
  return flag.pointer;
}

void check_output_flag(std::string_view op, std::string_view arg, const Flag& flag, Device device) {
  if (flag.where == Flag::Where::none) return;
  ops::check_device_scalar(op, arg, flag.pointer, flag.where == Flag::Where::device ? device : Device::cpu(), false);
}

MultiTensorPlan make_accumulate_plan(std::string_view op, std::span<const TensorView> buffers,
                                     std::span<const TensorView> values) {
  const PlanList lists[] = {{"buffers", buffers, true}, {"values", values, false}};
  MultiTensorPlan plan(op, lists);
  check_accumulate_dtypes(op, plan);
  return plan;
}

void run_accumulate(std::string_view op, const MultiTensorPlan& plan, Flag do_update, Flag overwrite,
                    Flag updated, Stream stream) {
  const Device device = plan.device();
  spec::AccumulateArgs args;
  args.do_update = flag_pointer(op, "do_update", do_update, device);
  args.overwrite = flag_pointer(op, "overwrite", overwrite, device);
  args.overwrite_value = overwrite.where == Flag::Where::host && overwrite.host_value;
  check_output_flag(op, "updated", updated, device);
  const bool skip = do_update.where == Flag::Where::host && !do_update.host_value;

  if (!skip) {
    if (device.is_cuda()) spec::accumulate_cuda(plan, args, stream);
    else spec::accumulate_cpu(plan, args);
  }
  if (updated.where == Flag::Where::host) *updated.pointer = true;
  if (updated.where == Flag::Where::device) {
    if (device.is_cuda()) spec::set_device_flag_cuda(device, updated.pointer, stream);
    else *updated.pointer = true;
  }
}

}  // namespace

std::span<const DTypePair> accumulate_dtype_pairs() { return kAccumulatePairs; }

bool is_accumulate_pair(DTypePair pair) {
  return std::find(kAccumulatePairs.begin(), kAccumulatePairs.end(), pair) != kAccumulatePairs.end();
}

ZeroPlan::ZeroPlan(std::span<const TensorView> buffers) {
  const PlanList lists[] = {{"buffers", buffers, true}};
  plan_ = MultiTensorPlan("zero", lists);
}

void ZeroPlan::run(Stream stream) const {
  if (plan_.empty()) return;
  if (plan_.device().is_cuda()) spec::zero_cuda(plan_, stream);
  else spec::zero_cpu(plan_);
}

AccumulatePlan::AccumulatePlan(std::span<const TensorView> buffers, std::span<const TensorView> values)
    : plan_(make_accumulate_plan("accumulate", buffers, values)) {}

void AccumulatePlan::accumulate(Flag do_update, Stream stream) const {
  run_accumulate("accumulate", plan_, do_update, Flag::none(), Flag::none(), stream);
}

void AccumulatePlan::accumulate_v2(Flag overwrite, Flag updated, Stream stream) const {
  run_accumulate("accumulate_v2", plan_, Flag::none(), overwrite, updated, stream);
}

void zero(std::span<const TensorView> buffers, Stream stream) { ZeroPlan(buffers).run(stream); }

void zero(const TensorView& buffer, Stream stream) { zero(std::span(&buffer, 1), stream); }

void accumulate(std::span<const TensorView> buffers, std::span<const TensorView> values, Flag do_update,
                Stream stream) {
  const MultiTensorPlan plan = make_accumulate_plan("accumulate", buffers, values);
  run_accumulate("accumulate", plan, do_update, Flag::none(), Flag::none(), stream);
}

void accumulate(const TensorView& buffer, const TensorView& value, Flag do_update, Stream stream) {
  accumulate(std::span(&buffer, 1), std::span(&value, 1), do_update, stream);
}

void accumulate_v2(std::span<const TensorView> buffers, std::span<const TensorView> values, Flag overwrite,
                   Flag updated, Stream stream) {
  const MultiTensorPlan plan = make_accumulate_plan("accumulate_v2", buffers, values);
  run_accumulate("accumulate_v2", plan, Flag::none(), overwrite, updated, stream);
}

void accumulate_v2(const TensorView& buffer, const TensorView& value, Flag overwrite, Flag updated,
                   Stream stream) {
  accumulate_v2(std::span(&buffer, 1), std::span(&value, 1), overwrite, updated, stream);
}

}  // namespace gradkit
