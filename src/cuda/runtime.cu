#include <string>

#include "spec/cuda_runtime.h"
#include "core/host_memory.h"
#include "core/pinned.h"
#include "cuda/check.h"

namespace gradkit {
namespace cuda {

DeviceGuard::DeviceGuard(int index) {
  GRADKIT_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != index) GRADKIT_CUDA_CHECK(cudaSetDevice(index));
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

}  // namespace cuda

namespace spec {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return count;
}

void require_cuda_device(std::string_view op, int index) {
  const int count = cuda_device_count();
  if (index < 0 || index >= count) {
    throw Error(ErrorCode::backend_unavailable,
                std::string(op) + ": cannot use cuda:" + std::to_string(index) + ": " +
                    std::to_string(count) + " CUDA device(s) visible");
  }
}

void check_memory_location(std::string_view op, std::string_view arg, size_t index,
                           const TensorView& view) {
  const std::string name = std::string(arg) + "[" + std::to_string(index) + "]";
  if (view.device.is_cuda()) require_cuda_device(op, view.device.index);
  else if (cuda_device_count() == 0) return;  // only host memory exists

  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, view.data) != cudaSuccess) {
    cudaGetLastError();
    attributes.type = cudaMemoryTypeUnregistered;
  }
  // Managed memory is reachable from both sides; pinned host memory is a host
  // buffer for gradkit's purposes (the CPU backend works on it).
  const bool on_device = attributes.type == cudaMemoryTypeDevice;
  const bool managed = attributes.type == cudaMemoryTypeManaged;
  if (view.device.is_cuda()) {
    if (!on_device && !managed) {
      throw_argument_error(ErrorCode::device_mismatch, op, name,
                           "is host memory, expected memory on " + to_string(view.device));
    }
    if (on_device && attributes.device != view.device.index) {
      throw_argument_error(ErrorCode::device_mismatch, op, name,
                           "is memory on cuda:" + std::to_string(attributes.device) + ", expected " +
                               to_string(view.device));
    }
  } else if (on_device) {
    throw_argument_error(ErrorCode::device_mismatch, op, name,
                         "is memory on cuda:" + std::to_string(attributes.device) +
                             ", expected host memory (the tensor says cpu)");
  }
}

// cudaMemset and cudaMemcpy from pageable memory run on the legacy default
// stream and may return before the device has finished; a kernel on a
// non-blocking stream could then read the memory too early. Every
// set-up copy below therefore waits for the legacy stream before it returns.
void finish_legacy_stream() { GRADKIT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy)); }

std::shared_ptr<void> allocate(Device device, size_t bytes) {
  require_cuda_device("allocate", device.index);
  cuda::DeviceGuard guard(device.index);
  void* pointer = nullptr;
  GRADKIT_CUDA_CHECK(cudaMalloc(&pointer, bytes == 0 ? 1 : bytes));
  // The deleter must not throw: it restores the device by hand.
  std::shared_ptr<void> owned(pointer, [index = device.index](void* p) {
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(index);
    cudaFree(p);
    if (previous >= 0) cudaSetDevice(previous);
  });
  GRADKIT_CUDA_CHECK(cudaMemset(pointer, 0, bytes));
  finish_legacy_stream();
  return owned;
}

std::shared_ptr<void> upload(Device device, const void* host, size_t bytes) {
  std::shared_ptr<void> owned = allocate(device, bytes);
  copy_from_host(owned.get(), host, bytes, device);
  return owned;
}

// "Synchronous" copies wait for all work on the device first: a plain
// cudaMemcpy orders only with the legacy stream, and a kernel on a
// non-blocking stream could still be writing what is read, or reading what
// is written (a step reading its learning rate, say).
void copy_to_host(void* host, const void* device_source, size_t bytes, Device device) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device.index);
  GRADKIT_CUDA_CHECK(cudaDeviceSynchronize());
  GRADKIT_CUDA_CHECK(cudaMemcpy(host, device_source, bytes, cudaMemcpyDeviceToHost));
}

void copy_from_host(void* device_destination, const void* host, size_t bytes, Device device) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device.index);
  GRADKIT_CUDA_CHECK(cudaDeviceSynchronize());
  GRADKIT_CUDA_CHECK(cudaMemcpy(device_destination, host, bytes, cudaMemcpyHostToDevice));
  finish_legacy_stream();
}

void copy_from_host_async(void* device_destination, const void* host, size_t bytes, Device device, Stream stream) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device.index);
  GRADKIT_CUDA_CHECK(cudaMemcpyAsync(device_destination, host, bytes, cudaMemcpyHostToDevice, cuda::native(stream)));
}

void synchronize(Device device) {
  cuda::DeviceGuard guard(device.index);
  GRADKIT_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace spec

namespace detail {

std::shared_ptr<void> allocate_registered(size_t bytes, bool huge_pages) {
  const auto refused = [bytes](ErrorCode code, const std::string& why) {
    return Error(code, "Buffer::pinned: cannot allocate " + std::to_string(bytes) +
                           " bytes of pinned host memory: " + why);
  };
  if (spec::cuda_device_count() == 0) throw refused(ErrorCode::backend_unavailable, "no CUDA device is visible");
  std::shared_ptr<void> host = map_host(bytes, huge_pages);
  if (!host) throw refused(ErrorCode::cuda_error, "the host has no such memory to give");
  // Portable: pinned for every CUDA context, as cudaHostAllocPortable's is;
  // mapped: reachable from the device, as cudaHostAlloc's memory is on
  // every system with unified addressing (all 64-bit ones).
  const cudaError_t status = cudaHostRegister(host.get(), bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (status != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the caller's next call
    throw refused(ErrorCode::cuda_error,
                  std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")");
  }
  // Unregistered before the memory is unmapped (`host` is released after).
  return std::shared_ptr<void>(host.get(), [host](void* p) mutable {
    cudaHostUnregister(p);
    host.reset();
  });
}

}  // namespace detail
}  // namespace gradkit
