#include "spec/step_counter.h"
#include "cuda/check.h"

namespace gradkit::spec {
namespace {

__global__ void increment_kernel(int64_t* counter, const bool* skip) {
  if (skip == nullptr || !*skip) ++*counter;
}

}  // namespace

void increment_counter_cuda(Device device, int64_t* counter, const bool* skip, Stream stream) {
  cuda::DeviceGuard guard(device.index);
  increment_kernel<<<1, 1, 0, cuda::native(stream)>>>(counter, skip);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gradkit::spec
