// Checks for the per-step scalars and flags that may live in device memory.
#pragma once

#include <cstddef>
#include <string_view>

#include "gradkit/core/device.h"

namespace gradkit::ops {

// Throws Error naming `arg` if `pointer` is null or its memory is not on
// `device` (host memory for the CPU backend). Null is allowed when
// `optional` is true.
// `alignment`: the scalar's, which the address must be a multiple of.
void check_device_scalar(std::string_view op, std::string_view arg, const void* pointer, size_t alignment,
                         Device device, bool optional = true);

template <class T>
void check_device_scalar(std::string_view op, std::string_view arg, const T* pointer, Device device,
                         bool optional = true) {
  check_device_scalar(op, arg, static_cast<const void*>(pointer), alignof(T), device, optional);
}

}  // namespace gradkit::ops
