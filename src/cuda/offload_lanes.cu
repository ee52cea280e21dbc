// The CUDA side of an offloaded step: pinned host memory, three streams,
// events between them and host functions (src/optim/offload_lanes.h).
#include <cstring>
#include <string>
#include <vector>

#include "spec/cuda_runtime.h"
#include "core/pinned.h"
#include "cuda/check.h"
#include "optim/offload_lanes.h"

namespace gradkit::detail {

std::shared_ptr<void> allocate_pinned(size_t bytes) {
  void* pointer = nullptr;
  const cudaError_t status = cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable);
  if (status != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the caller's next call
    throw Error(spec::cuda_device_count() == 0 ? ErrorCode::backend_unavailable : ErrorCode::cuda_error,
                "Buffer::pinned: cannot allocate " + std::to_string(bytes) + " bytes of pinned host memory: " +
                    cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
  }
  std::memset(pointer, 0, bytes);
  return std::shared_ptr<void>(pointer, [](void* p) { cudaFreeHost(p); });
}

struct OffloadLanes::Impl {
  int device = 0;
  cudaStream_t streams[2] = {nullptr, nullptr};
  std::vector<cudaEvent_t> slots;
};

namespace {

// An event recorded on `from` and waited for by `to`. Destroying it at once
// is allowed: CUDA releases it once the recorded work has completed.
void order(cudaStream_t from, cudaStream_t to) {
  cudaEvent_t event = nullptr;
  GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, from);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(to, event, 0) : recorded;
  cudaEventDestroy(event);
  GRADKIT_CUDA_CHECK(waited);
}

// Waits for and frees what was made (never throws: destructors use it).
void release(OffloadLanes::Impl& impl) {
  for (cudaStream_t& s : impl.streams) {
    if (s == nullptr) continue;
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    s = nullptr;
  }
  for (cudaEvent_t e : impl.slots) cudaEventDestroy(e);
  impl.slots.clear();
}

}  // namespace

OffloadLanes::OffloadLanes(std::string_view op, Device device, int slots) : impl_(std::make_unique<Impl>()) {
  if (!device.is_cuda()) {
    throw_argument_error(ErrorCode::device_mismatch, op, "device", "is cpu, expected a CUDA device");
  }
  spec::require_cuda_device(op, device.index);
  impl_->device = device.index;
  cuda::DeviceGuard guard(device.index);
  for (cudaStream_t& s : impl_->streams) {
    const cudaError_t status = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (status != cudaSuccess) {
      release(*impl_);
      GRADKIT_CUDA_CHECK(status);
    }
  }
  for (int i = 0; i < slots; ++i) {
    cudaEvent_t event = nullptr;
    const cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (status != cudaSuccess) {
      release(*impl_);
      GRADKIT_CUDA_CHECK(status);
    }
    impl_->slots.push_back(event);
  }
}

OffloadLanes::~OffloadLanes() {
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(impl_->device);
  release(*impl_);
  if (previous >= 0) cudaSetDevice(previous);
}

void OffloadLanes::wait_for(Lane lane, Stream caller) {
  cuda::DeviceGuard guard(impl_->device);
  order(cuda::native(caller), impl_->streams[lane]);
}


void OffloadLanes::make_wait(Stream caller, Lane lane) {
  cuda::DeviceGuard guard(impl_->device);
  order(impl_->streams[lane], cuda::native(caller));
}

void OffloadLanes::copy(Lane lane, void* destination, const void* source, size_t bytes) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(impl_->device);
  GRADKIT_CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, impl_->streams[lane]));
}

void OffloadLanes::record(Lane lane, int slot) {
  cuda::DeviceGuard guard(impl_->device);
  GRADKIT_CUDA_CHECK(cudaEventRecord(impl_->slots.at(static_cast<size_t>(slot)), impl_->streams[lane]));
}

void OffloadLanes::host_wait(int slot) {
  cuda::DeviceGuard guard(impl_->device);
  GRADKIT_CUDA_CHECK(cudaEventSynchronize(impl_->slots.at(static_cast<size_t>(slot))));
}

Stream OffloadLanes::stream(Lane lane) const { return Stream{impl_->streams[lane]}; }

void OffloadLanes::synchronize() {
  cuda::DeviceGuard guard(impl_->device);
  for (cudaStream_t s : impl_->streams) GRADKIT_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace gradkit::detail
