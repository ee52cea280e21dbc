// What the core needs from the CUDA runtime, behind a plain C++ interface so
// that the core compiles without CUDA headers. Implemented in
// src/cuda/runtime.cu, or by src/core/no_cuda.cc in a build without CUDA
// (where every CUDA request is an Error::backend_unavailable).
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "gradkit/core/tensor.h"

namespace gradkit::spec {

int cuda_device_count();

// Throws Error(device_mismatch) naming `arg`[index] if the memory at
// view.data is not where view.device says (host memory passed as cuda:N,
// device memory passed as cpu, or memory of another GPU).
void check_memory_location(std::string_view op, std::string_view arg, size_t index,
                           const TensorView& view);

// Copies `bytes` from host memory to a new allocation on `device`
// (synchronously) and returns it; the allocation is freed with the last owner.
std::shared_ptr<void> upload(Device device, const void* host, size_t bytes);

// A zero-filled allocation of `bytes` on a CUDA device, freed with the last owner.
std::shared_ptr<void> allocate(Device device, size_t bytes);
// Synchronous copies between host memory and a CUDA device.
void copy_to_host(void* host, const void* device_source, size_t bytes, Device device);
void copy_from_host(void* device_destination, const void* host, size_t bytes, Device device);
// A copy enqueued on `stream`; `host` may be reused as soon as it returns
// (pageable memory is staged before the call returns).
void copy_from_host_async(void* device_destination, const void* host, size_t bytes, Device device, Stream stream);
void synchronize(Device device);

// Throws backend_unavailable naming `op` unless CUDA device `index` can be used.
void require_cuda_device(std::string_view op, int index);

}  // namespace gradkit::spec
