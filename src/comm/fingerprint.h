// A call's fingerprint for checked mode: which collective, the reduction, the
// tensor count, the total element count, the dtype, a hash of the element
// counts in order, and the communicator's settings that decide which
// collectives the call issues. Every rank gathers every rank's fingerprint (a few dozen
// bytes each), so all ranks see the same mismatch and throw the same error.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "gradkit/comm/communicator.h"

namespace gradkit::comm {

enum class CallKind : uint32_t {
  all_reduce = 1,
  all_gather,
  reduce_scatter,
  all_reduce_buffer,
  all_gather_buffer,
  reduce_scatter_buffer,
  adasum,  // `reduce`: 0 for flat Adasum, the ranks per node for hierarchical
  all_gather_buffers,
  reduce_scatter_buffers,
};

struct Fingerprint {
  uint32_t kind = 0;
  uint32_t reduce = 0;
  uint32_t dtype = 0;
  uint32_t settings = 0;  // Communicator::list_settings() for list all-reduce, else 0
  int64_t count = 0;
  int64_t total = 0;
  uint64_t sizes_hash = 0;
};
static_assert(sizeof(Fingerprint) == 40);

// `variant`: the ReduceOp of a reducing collective, Adasum's ranks per node.
Fingerprint fingerprint_of(CallKind kind, uint32_t variant, std::span<const TensorView> tensors,
                           uint32_t settings = 0);

struct Mismatch {
  int rank = 0;        // the first rank whose call differs from rank 0's
  bool sizes = false;  // only the element counts differ: gather them to say which tensor
  std::string what;    // the difference, when it is not in the sizes
};

// The first difference between rank 0's fingerprint and another rank's.
std::optional<Mismatch> find_mismatch(std::span<const Fingerprint> all);

// Given each rank's element counts (padded with -1 to the longest list,
// `stride` entries per rank), names the first tensor whose count differs
// between rank 0 and `rank`.
std::string describe_size_mismatch(std::span<const int64_t> all_counts, size_t stride, int rank);

}  // namespace gradkit::comm
