#include "ops/device_scalar.h"

#include <cstdint>
#include <string>

#include "spec/cuda_runtime.h"
#include "gradkit/core/error.h"

namespace gradkit::ops {

void check_device_scalar(std::string_view op, std::string_view arg, const void* pointer, size_t alignment,
                         Device device, bool optional) {
  if (pointer == nullptr) {
    if (optional) return;
    throw_argument_error(ErrorCode::null_pointer, op, arg, "is a null pointer; expected memory on " + to_string(device));
  }
  if (reinterpret_cast<uintptr_t>(pointer) % alignment != 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, arg,
                         "is not aligned to its " + std::to_string(alignment) + "-byte type; expected an aligned pointer");
  }
  spec::check_memory_location(op, arg, 0, TensorView{const_cast<void*>(pointer), 1, DType::f32, device});
}

}  // namespace gradkit::ops
