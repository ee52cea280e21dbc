// How the sharded Muon tests (test_muon_sharded, comm/test_muon_sharded_step)
// split a tensor's rows over ranks, as FSDP2's Shard(0) does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gradkit/core/memory.h"
#include "support/test_tensor.h"

namespace gradkit::test {

// torch.chunk's split of `slices` dim-0 slices of `rows_per_slice` rows each
// over `ranks`: ceil(slices / ranks) slices each, the last ranks short or
// empty; ranks + 1 row boundaries.
inline std::vector<int64_t> chunk_splits(int64_t slices, int64_t rows_per_slice, int ranks) {
  const int64_t each = (slices + ranks - 1) / ranks;
  std::vector<int64_t> out;
  for (int r = 0; r <= ranks; ++r) out.push_back(std::min<int64_t>(r * each, slices) * rows_per_slice);
  return out;
}

// Rows [lo, hi) of a row-major matrix list with `cols` columns.
inline std::vector<double> rows_of(const std::vector<double>& v, int64_t cols, int64_t lo, int64_t hi) {
  return {v.begin() + lo * cols, v.begin() + hi * cols};
}

// New values (rounded to the tensor's dtype) in the tensor's memory.
inline void overwrite(const TestTensor& t, const std::vector<double>& values) {
  const TestTensor fresh(t.view().device, t.view().dtype, values);
  const auto bytes = fresh.bytes();
  if (!bytes.empty()) copy_from_host(t.view().data, t.view().device, bytes.data(), bytes.size());
}

}  // namespace gradkit::test
