// create_nccl_communicator from a unique id, which needs no MPI: its
// arguments checked, NCCL loaded, the GPU found, and the NcclCommunicator
// (nccl_communicator.h) started; create_nccl_unique_id. The factory over
// MPI is nccl_create_mpi.cc's.
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "spec/cuda_runtime.h"
#include "comm/nccl/nccl_check.h"
#include "comm/nccl/nccl_communicator.h"
#include "cuda/check.h"

namespace gradkit {

static_assert(sizeof(ncclUniqueId) == 128 && sizeof(NcclUniqueId::bytes) == sizeof(ncclUniqueId),
              "NcclUniqueId holds an ncclUniqueId byte for byte");

bool has_nccl_communicator() { return true; }

NcclUniqueId create_nccl_unique_id() {
  const comm::NcclLibrary& nccl = comm::nccl_library("create_nccl_unique_id");
  ncclUniqueId id{};
  GRADKIT_NCCL_CHECK(nccl.ncclGetUniqueId(&id));
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

std::unique_ptr<Communicator> create_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                       const CommunicatorOptions& options) {
  constexpr std::string_view op = "create_nccl_communicator";
  // Every argument before any NCCL call: a rank that fails here never joins,
  // and the others give up after their timeout.
  if (size < 1) {
    throw_argument_error(ErrorCode::invalid_argument, op, "size", "is " + std::to_string(size) + ", expected >= 1");
  }
  if (rank < 0 || rank >= size) {
    throw_argument_error(ErrorCode::invalid_argument, op, "rank",
                         "is " + std::to_string(rank) + ", expected 0 <= rank < size (" + std::to_string(size) + ")");
  }
  if (options.timeout.count() <= 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.timeout",
                         "is " + std::to_string(options.timeout.count()) + " ms, expected > 0");
  }
  if (options.cuda_device < -1) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.cuda_device",
                         "is " + std::to_string(options.cuda_device) +
                             ", expected -1 (the current device) or a CUDA device ordinal");
  }
  comm::nccl_library(op);
  const int visible = spec::cuda_device_count();
  if (visible == 0) {
    throw Error(ErrorCode::backend_unavailable,
                std::string(op) + ": rank " + std::to_string(rank) + " sees no CUDA device");
  }
  if (options.cuda_device >= visible) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.cuda_device",
                         "is " + std::to_string(options.cuda_device) + ", expected -1 (the current device) or < " +
                             std::to_string(visible) + " (the CUDA devices visible)");
  }
  int index = options.cuda_device;
  if (index < 0) GRADKIT_CUDA_CHECK(cudaGetDevice(&index));
  ncclUniqueId nccl_id{};
  std::memcpy(&nccl_id, id.bytes.data(), sizeof(nccl_id));
  // The local layout is a placeholder until start() has gathered the host names.
  auto c = std::make_unique<comm::NcclCommunicator>(rank, size, 0, 1, index, options, nullptr);
  c->start(nccl_id);
  return c;
}

}  // namespace gradkit
