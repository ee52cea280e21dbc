// A build without CUDA or without NCCL: Adasum runs on the MPI communicator
// (host memory) only, and a CUDA list is refused with a clear error.
#include "spec/adasum.h"
#include "gradkit/core/error.h"

namespace gradkit::comm::adasum {

std::unique_ptr<AdasumDevice> make_cuda_adasum_device(int index) {
  throw Error(ErrorCode::backend_unavailable,
              "adasum: cannot run on cuda:" + std::to_string(index) +
                  ": gradkit was built without CUDA and NCCL; use an MPI communicator and host memory");
}

}  // namespace gradkit::comm::adasum
