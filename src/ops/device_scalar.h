// Checks for the per-step scalars and flags that may live in device memory.
#pragma once

#include <string_view>

#include "gradkit/core/device.h"

namespace gradkit::ops {

// Throws Error naming `arg` if `pointer` is null or its memory is not on
// `device` (host memory for the CPU backend). Null is allowed when
// `optional` is true.
void check_device_scalar(std::string_view op, std::string_view arg, const void* pointer, Device device,
                         bool optional = true);

}  // namespace gradkit::ops
