// create_nccl_communicator over MPI (built with MPI and NCCL): its
// arguments checked, every rank's NCCL and GPU found, rank 0's unique id
// broadcast, and the NcclCommunicator (nccl_communicator.h) started with
// the MpiChannel for its host exchanges.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "spec/cuda_runtime.h"
#include "comm/mpi/mpi_channel.h"
#include "comm/nccl/nccl_check.h"
#include "comm/nccl/nccl_communicator.h"

namespace gradkit {

std::unique_ptr<Communicator> create_nccl_communicator(const CommunicatorOptions& options, MpiCommHandle comm) {
  constexpr std::string_view op = "create_nccl_communicator";
  if (options.timeout.count() <= 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.timeout",
                         "is " + std::to_string(options.timeout.count()) + " ms, expected > 0");
  }
  auto channel = std::make_unique<comm::MpiChannel>(comm, options.timeout);
  const int index = options.cuda_device >= 0 ? options.cuda_device : channel->local_rank();
  const int visible = spec::cuda_device_count();
  std::string no_nccl;  // why this rank cannot load NCCL
  try {
    comm::nccl_library(op);
  } catch (const Error& e) {
    no_nccl = e.what();
  }
  // Every rank learns whether every rank has NCCL and its GPU before any of
  // them starts NCCL, so that a host short of either fails everywhere at
  // once instead of leaving the others waiting.
  const int mine = no_nccl.empty() && index < visible ? 1 : 0;
  std::vector<int> ready(static_cast<size_t>(channel->size()));
  channel->all_gather_bytes(&mine, ready.data(), sizeof(int));
  for (int r = 0; r < channel->size(); ++r) {
    if (ready[static_cast<size_t>(r)] != 0) continue;
    if (r == channel->rank() && !no_nccl.empty()) throw Error(ErrorCode::backend_unavailable, no_nccl);
    if (r == channel->rank()) {
      throw Error(ErrorCode::backend_unavailable,
                  std::string(op) + ": rank " + std::to_string(r) + " (local rank " +
                      std::to_string(channel->local_rank()) + " of " + std::to_string(channel->local_size()) +
                      ") needs cuda:" + std::to_string(index) + ", but " + std::to_string(visible) +
                      " CUDA device(s) are visible on its host");
    }
    throw Error(ErrorCode::backend_unavailable,
                std::string(op) + ": rank " + std::to_string(r) +
                    " has no NCCL or no GPU for its local rank; no rank starts NCCL");
  }
  ncclUniqueId id{};
  if (channel->rank() == 0) GRADKIT_NCCL_CHECK(comm::nccl().ncclGetUniqueId(&id));
  channel->broadcast_bytes(&id, sizeof(id), 0);
  const int rank = channel->rank(), size = channel->size();
  const int local_rank = channel->local_rank(), local_size = channel->local_size();
  auto c = std::make_unique<comm::NcclCommunicator>(rank, size, local_rank, local_size, index, options, std::move(channel));
  c->start(id);
  return c;
}

}  // namespace gradkit
