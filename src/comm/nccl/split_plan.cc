#include "comm/nccl/split_plan.h"

namespace gradkit::comm {

SplitPlan::SplitPlan(std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                     const unsigned char* source, unsigned char* destination, DType dtype, size_t direct_bytes) {
  const size_t element = dtype_size(dtype);
  outputs_.reserve(outputs.size());
  size_t offset = 0;  // bytes into the concatenation
  for (size_t i = 0; i < inputs.size(); ++i) {
    TensorView in = inputs[i];
    TensorView out = outputs[i];
    if (source != nullptr) in.data = const_cast<unsigned char*>(source) + offset;
    if (destination != nullptr) out.data = destination + offset;
    offset += static_cast<size_t>(in.numel) * element;
    if (in.numel == 0) continue;
    outputs_.push_back(out);
    if (goes_direct(in, direct_bytes)) {
      direct_.push_back({in.data, out.data, in.numel});
    } else {
      packed_inputs_.push_back(in);
      packed_outputs_.push_back(out);
      packed_total_ += in.numel;
    }
  }
}

const MultiTensorPlan& SplitPlan::divide_plan() const {
  // The collective has checked the outputs against each other; the plan
  // checks them again, once per list.
  std::call_once(divide_plan_made_, [&] {
    const PlanList lists[] = {{"outputs", outputs_, true}};
    divide_plan_ = MultiTensorPlan("all_reduce (average)", lists);
  });
  return divide_plan_;
}

}  // namespace gradkit::comm
