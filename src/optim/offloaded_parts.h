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
  std::vector<int> pieces;      // indices into pieces_
};

// Elements [offset, offset + count) of one flat tensor.
struct OffloadSlice {
  size_t tensor;
  int64_t offset, count;
};

struct OffloadedAdam::Piece {
  std::vector<OffloadSlice> slices;
  AdamPlan plan;  // the CPU step over the slices of the host tensors
};

// Event slots of the lanes: one per piece (its gradients have arrived),
// then one for the check's scalars.
inline int scalars_slot(int num_pieces) { return num_pieces; }

// Cuts a bucket's tensors (`numel` and gradient element size per flat
// tensor) into pieces of about `piece_bytes` of gradients, a tensor cut only
// at multiples of `align` elements. Every element lies in exactly one slice.
std::vector<std::vector<OffloadSlice>> cut_pieces(const std::vector<size_t>& tensors, const std::vector<TensorView>& grads,
                                                  size_t piece_bytes, int64_t align);

}  // namespace gradkit
