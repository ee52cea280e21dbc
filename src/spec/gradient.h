// The gradient-control kernels each backend implements, over a validated plan.
#pragma once

#include "gradkit/core/multi_tensor_plan.h"

namespace gradkit::spec {

// buffer = (overwrite ? 0 : buffer) + value, gated by do_update.
// Pointers are device flags (host memory for the CPU backend), or null.
struct AccumulateArgs {
  const bool* do_update = nullptr;  // null: always update
  const bool* overwrite = nullptr;  // null: use overwrite_value
  bool overwrite_value = false;
};

// Plan lists: zero {buffers}; accumulate {buffers, values}.
void zero_cpu(const MultiTensorPlan& plan);
void accumulate_cpu(const MultiTensorPlan& plan, const AccumulateArgs& args);

void zero_cuda(const MultiTensorPlan& plan, Stream stream);
void accumulate_cuda(const MultiTensorPlan& plan, const AccumulateArgs& args, Stream stream);
// *flag = true, enqueued on the stream (capturable).
void set_device_flag_cuda(Device device, bool* flag, Stream stream);

}  // namespace gradkit::spec
