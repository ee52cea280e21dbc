#include "ops/device_scalar.h"

#include "backend/cuda_runtime.h"
#include "gradkit/core/error.h"

namespace gradkit::ops {

void check_device_scalar(std::string_view op, std::string_view arg, const void* pointer, Device device,
                         bool optional) {
  if (pointer == nullptr) {
    if (optional) return;
    throw_argument_error(ErrorCode::null_pointer, op, arg, "is a null pointer; expected memory on " + to_string(device));
  }
  backend::check_memory_location(op, arg, 0, TensorView{const_cast<void*>(pointer), 1, DType::f32, device});
}

}  // namespace gradkit::ops
