// The CUDA runtime interface in a build without CUDA: no devices, and every
// request for one is a clear error rather than a silent CPU fallback.
#include <string>

#include "backend/cuda_runtime.h"
#include "gradkit/core/error.h"

namespace gradkit::backend {

int cuda_device_count() { return 0; }

void check_memory_location(std::string_view op, std::string_view arg, size_t index,
                           const TensorView& view) {
  if (view.device.is_cuda()) {
    throw_argument_error(ErrorCode::backend_unavailable, op,
                         std::string(arg) + "[" + std::to_string(index) + "]",
                         "is on " + to_string(view.device) + ", but gradkit was built without CUDA");
  }
}

std::shared_ptr<void> upload(Device device, const void*, size_t) {
  throw Error(ErrorCode::backend_unavailable,
              "cannot use " + to_string(device) + ": gradkit was built without CUDA");
}

void require_cuda_device(std::string_view op, int index) {
  throw Error(ErrorCode::backend_unavailable, std::string(op) + ": cannot use cuda:" +
                                                  std::to_string(index) +
                                                  ": gradkit was built without CUDA");
}

}  // namespace gradkit::backend
