// A build without MPI (not found, or GRADKIT_MPI=OFF): the MPI
// communicator and MpiEnvironment refuse with a clear error. The rest of
// the layer (the NCCL communicator from a unique id, the list collectives,
// the gradient arena, Adasum, the sharded optimizers) needs no MPI.
#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"

namespace gradkit {

namespace {

[[noreturn]] void refuse(const char* op) {
  throw Error(ErrorCode::backend_unavailable,
              std::string(op) + ": gradkit was built without MPI (MPI not found, or GRADKIT_MPI=OFF); make an NCCL "
                                "communicator from a unique id (create_nccl_communicator(id, rank, size)) instead");
}

}  // namespace

bool has_mpi_communicator() { return false; }

MpiEnvironment::MpiEnvironment(int*, char***) { refuse("MpiEnvironment"); }

MpiEnvironment::~MpiEnvironment() = default;

std::unique_ptr<Communicator> create_mpi_communicator(const CommunicatorOptions&, MpiCommHandle) {
  refuse("create_mpi_communicator");
}

}  // namespace gradkit
