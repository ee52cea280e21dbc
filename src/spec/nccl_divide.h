// The average's last step on the GPU: each element divided by the rank count
// in f32 (f64 for f64) and rounded once, as comm/host_divide.h does on the
// host. (NCCL's ncclAvg is not used: for floating types it multiplies each
// rank's input by 1/n before summing, which rounds n more times and flushes
// small f16 values to zero.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gradkit/core/dtype.h"
#include "gradkit/core/multi_tensor_plan.h"

namespace gradkit::comm {

void divide_on_device(void* data, int64_t count, DType dtype, int divisor, cudaStream_t stream);
// The same over every tensor of the plan's first list, in one launch.
void divide_on_device(const MultiTensorPlan& plan, int divisor, cudaStream_t stream);

}  // namespace gradkit::comm
