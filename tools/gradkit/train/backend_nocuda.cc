#include "gradkit/core/error.h"
#include "train/backend.h"

namespace gradkit::train {

std::unique_ptr<TrainBackend> make_cuda_backend(const TrainOptions&, const FashionMnist&, Device device) {
  throw Error(ErrorCode::backend_unavailable, "--device " + to_string(device) + " needs a build with CUDA and NCCL");
}

}  // namespace gradkit::train
