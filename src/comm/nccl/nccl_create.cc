// create_nccl_communicator: its arguments checked, the ranks' GPUs found,
// the unique id shared, and the NcclCommunicator (nccl_communicator.h)
// started.
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "spec/cuda_runtime.h"
#include "comm/mpi/mpi_channel.h"
#include "comm/nccl/nccl_check.h"
#include "comm/nccl/nccl_communicator.h"
#include "cuda/check.h"

namespace gradkit {

static_assert(sizeof(ncclUniqueId) == 128 && sizeof(NcclUniqueId::bytes) == sizeof(ncclUniqueId),
              "NcclUniqueId holds an ncclUniqueId byte for byte");

bool has_nccl_communicator() { return true; }

std::unique_ptr<Communicator> create_nccl_communicator(const CommunicatorOptions& options, MpiCommHandle comm) {
  constexpr std::string_view op = "create_nccl_communicator";
  if (options.timeout.count() <= 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.timeout",
                         "is " + std::to_string(options.timeout.count()) + " ms, expected > 0");
  }
  auto channel = std::make_unique<comm::MpiChannel>(comm, options.timeout);
  const int index = options.cuda_device >= 0 ? options.cuda_device : channel->local_rank();
  const int visible = spec::cuda_device_count();
  // Every rank learns whether every rank has its GPU before any of them
  // starts NCCL, so that a host short of GPUs fails everywhere at once
  // instead of leaving the others waiting.
  const int mine = index < visible ? 1 : 0;
  std::vector<int> ready(static_cast<size_t>(channel->size()));
  channel->all_gather_bytes(&mine, ready.data(), sizeof(int));
  for (int r = 0; r < channel->size(); ++r) {
    if (ready[static_cast<size_t>(r)] != 0) continue;
    if (r == channel->rank()) {
      throw Error(ErrorCode::backend_unavailable,
                  std::string(op) + ": rank " + std::to_string(r) + " (local rank " +
                      std::to_string(channel->local_rank()) + " of " + std::to_string(channel->local_size()) +
                      ") needs cuda:" + std::to_string(index) + ", but " + std::to_string(visible) +
                      " CUDA device(s) are visible on its host");
    }
    throw Error(ErrorCode::backend_unavailable,
                std::string(op) + ": rank " + std::to_string(r) + " has no GPU for its local rank; no rank starts NCCL");
  }
  ncclUniqueId id{};
  if (channel->rank() == 0) GRADKIT_NCCL_CHECK(ncclGetUniqueId(&id));
  channel->broadcast_bytes(&id, sizeof(id), 0);
  const int rank = channel->rank(), size = channel->size();
  const int local_rank = channel->local_rank(), local_size = channel->local_size();
  auto c = std::make_unique<comm::NcclCommunicator>(rank, size, local_rank, local_size, index, options, std::move(channel));
  c->start(id);
  return c;
}

NcclUniqueId create_nccl_unique_id() {
  ncclUniqueId id{};
  GRADKIT_NCCL_CHECK(ncclGetUniqueId(&id));
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
