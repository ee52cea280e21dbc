#include "comm/stream_order.h"

#include "cuda/check.h"

namespace gradkit::comm {

void stream_wait(Device device, Stream waiter, Stream producer) {
  if (waiter.handle == producer.handle) return;  // one stream is already in order
  cuda::DeviceGuard guard(device.index);
  cudaEvent_t event = nullptr;
  GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  // The wait captures the event's state now, so it may be destroyed at once.
  const cudaError_t recorded = cudaEventRecord(event, cuda::native(producer));
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(cuda::native(waiter), event, 0) : recorded;
  GRADKIT_CUDA_CHECK(cudaEventDestroy(event));
  GRADKIT_CUDA_CHECK(recorded);
  GRADKIT_CUDA_CHECK(waited);
}

}  // namespace gradkit::comm
