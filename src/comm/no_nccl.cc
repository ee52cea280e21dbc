// A build without CUDA or without nccl.h: a clear error for anyone who
// asks for NCCL (the MPI communicator, where gradkit has MPI, serves host
// memory).
#include "comm/stream_order.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"

namespace gradkit {

bool has_nccl_communicator() { return false; }

std::unique_ptr<Communicator> create_nccl_communicator(const CommunicatorOptions&, MpiCommHandle) {
  throw Error(ErrorCode::backend_unavailable,
              "create_nccl_communicator: gradkit was built without NCCL (it needs the CUDA backend and nccl.h); "
              "use create_mpi_communicator for host memory");
}

NcclUniqueId create_nccl_unique_id() {
  throw Error(ErrorCode::backend_unavailable, "create_nccl_unique_id: gradkit was built without NCCL");
}

std::unique_ptr<Communicator> create_nccl_communicator(const NcclUniqueId&, int, int, const CommunicatorOptions&) {
  throw Error(ErrorCode::backend_unavailable,
              "create_nccl_communicator: gradkit was built without NCCL (it needs the CUDA backend and nccl.h)");
}

}  // namespace gradkit

namespace gradkit::comm {

void stream_wait(Device device, Stream, Stream) {
  throw Error(ErrorCode::backend_unavailable,
              "cannot order streams on " + to_string(device) + ": gradkit was built without NCCL");
}

}  // namespace gradkit::comm
