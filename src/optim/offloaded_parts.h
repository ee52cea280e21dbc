// What the files of OffloadedAdam share (offloaded.cc: making it;
// offloaded_step.cc: the step; offloaded_state.cc: its state file).
#pragma once

#include <cstddef>
#include <vector>

#include "gradkit/optim/offloaded.h"
#include "optim/host_worker.h"
#include "optim/offload_lanes.h"

namespace gradkit {

inline constexpr std::string_view kOffloadedOp = "OffloadedAdam";

// The gradient check's outputs, on the device and copied to the host.
struct OffloadScalars {
  float grad_divisor;
  float global_norm;
  bool found_inf;
};

struct OffloadedAdam::Bucket {
  std::vector<size_t> tensors;  // indices into the flat params, ascending
  AdamPlan plan;                // the CPU step over this bucket's host tensors
};

// Event slots of the lanes: one per bucket (its gradients have arrived),
// then one for the check's scalars.
inline int scalars_slot(int num_buckets) { return num_buckets; }

}  // namespace gradkit
