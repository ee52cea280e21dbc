// MuonShardedPlan's whole step over a gradkit communicator: its three
// parts with the all-to-alls between them (Communicator::all_to_all, one
// each way per bucket), on one stream, bucket by bucket: its momentum, its
// exchange, its products beside the stream (orthogonalize_beside) while the
// stream carries the next bucket's momentum and exchange; then its products
// joined, its rows back and their update (a plan of one bucket runs its
// parts in order on the stream: nothing to overlap). For C++
// frameworks; gradkit.torch runs the same parts with torch.distributed's
// all_to_all_single on torch's communication stream.
#pragma once

#include "gradkit/comm/communicator.h"
#include "gradkit/ops/muon_sharded.h"

namespace gradkit {

// `comm` must span the plan's ranks with this rank as the plan's rank, on
// the plan's device (checked first, naming `comm`); every rank calls it.
void muon_sharded_step(const MuonShardedPlan& plan, Communicator& comm, const MuonStepInputs& inputs = {},
                       Stream stream = {});

}  // namespace gradkit
