#include <string>

#include "bench_device.h"
#include "gradkit/core/error.h"

namespace gradkit::tool {

std::unique_ptr<BenchDevice> make_cuda_bench_device(int index) {
  throw Error(ErrorCode::backend_unavailable,
              "bench: cannot use cuda:" + std::to_string(index) + ": gradkit was built without CUDA");
}

}  // namespace gradkit::tool
