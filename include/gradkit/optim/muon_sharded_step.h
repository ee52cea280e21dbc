// MuonShardedPlan's whole step over a gradkit communicator: its three
// parts with the two all-to-alls between them (Communicator::all_to_all,
// one per bucket), in order on one stream. For C++ frameworks; gradkit.torch
// runs the same parts bucket by bucket with torch.distributed's
// all_to_all_single on its own stream, so that the exchanges overlap the
// owners' products.
#pragma once

#include "gradkit/comm/communicator.h"
#include "gradkit/ops/muon_sharded.h"

namespace gradkit {

// `comm` must span the plan's ranks with this rank as the plan's rank, on
// the plan's device (checked first, naming `comm`); every rank calls it.
void muon_sharded_step(const MuonShardedPlan& plan, Communicator& comm, const MuonStepInputs& inputs = {},
                       Stream stream = {});

}  // namespace gradkit
