// A build with NCCL but without MPI (not found, or GRADKIT_MPI=OFF): the
// NCCL communicator bootstrapped over MPI (nccl_create_mpi.cc) refuses with
// a clear error; the one from a unique id (nccl_create.cc) needs no MPI.
#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"

namespace gradkit {

std::unique_ptr<Communicator> create_nccl_communicator(const CommunicatorOptions&, MpiCommHandle) {
  throw Error(ErrorCode::backend_unavailable,
              "create_nccl_communicator: gradkit was built without MPI (MPI not found, or GRADKIT_MPI=OFF), which "
              "this form bootstraps NCCL over; pass a unique id, a rank and a size instead "
              "(create_nccl_communicator(id, rank, size))");
}

}  // namespace gradkit
