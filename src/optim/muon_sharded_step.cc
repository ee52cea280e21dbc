// MuonShardedPlan's step over a communicator (gradkit/optim/muon_sharded_step.h).
#include "gradkit/optim/muon_sharded_step.h"

#include <string>

#include "gradkit/core/error.h"

namespace gradkit {

void muon_sharded_step(const MuonShardedPlan& plan, Communicator& comm, const MuonStepInputs& inputs, Stream stream) {
  constexpr std::string_view name = "muon_sharded_step";
  if (comm.size() != plan.ranks() || comm.rank() != plan.rank() || comm.device() != plan.device()) {
    throw_argument_error(ErrorCode::invalid_argument, name, "comm",
                         "is rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " on " +
                             to_string(comm.device()) + ", expected the plan's rank " + std::to_string(plan.rank()) +
                             " of " + std::to_string(plan.ranks()) + " on " + to_string(plan.device()));
  }
  plan.validate_inputs(inputs);
  comm.require_usable(name);  // before the momentum moves: a failed communicator would leave it half-stepped
  // Bucket by bucket: its momentum, its exchange, then its products beside
  // the stream (MuonShardedPlan::orthogonalize_beside), so that the next
  // bucket's momentum and exchange run while they do; then, bucket by
  // bucket, the products joined, the rows back and their update, which runs
  // while the next bucket's products still do. What stays on the critical
  // path is the first bucket's momentum and exchange, every bucket's
  // products, and the last bucket's exchange back and update. A plan of one
  // bucket has nothing to overlap: its products run on the stream, as
  // gradkit.torch.Muon runs them (the side-stream path costs a one-bucket
  // step time of its own; measured: bench/log/2026-11-26.md, "Muon's
  // exchanges in buckets").
  const bool beside = plan.num_buckets() > 1;
  for (size_t k = 0; k < plan.num_buckets(); ++k) {
    plan.momentum(k, inputs, stream);
    comm.all_to_all(plan.shard_buffer(k), plan.shard_counts(k), plan.owner_buffer(k), plan.owner_counts(k), stream);
    if (beside) plan.orthogonalize_beside(k, inputs, stream);
    else plan.orthogonalize(k, inputs, stream);
  }
  for (size_t k = 0; k < plan.num_buckets(); ++k) {
    if (beside) plan.join(k, stream);
    comm.all_to_all(plan.owner_buffer(k), plan.owner_counts(k), plan.shard_buffer(k), plan.shard_counts(k), stream);
    plan.update(k, inputs, stream);
  }
}

}  // namespace gradkit
