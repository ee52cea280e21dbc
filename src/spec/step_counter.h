// The device-side step counter the owning optimizers keep.
#pragma once

#include <cstdint>

#include "gradkit/core/tensor.h"

namespace gradkit::spec {

// Enqueues ++*counter unless skip != null and *skip (both in device memory).
void increment_counter_cuda(Device device, int64_t* counter, const bool* skip, Stream stream);

// The same on either backend: done now for the CPU (host memory), enqueued for CUDA.
inline void increment_counter(Device device, int64_t* counter, const bool* skip, Stream stream) {
  if (device.is_cuda()) increment_counter_cuda(device, counter, skip, stream);
  else if (skip == nullptr || !*skip) ++*counter;
}

}  // namespace gradkit::spec
