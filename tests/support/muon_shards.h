// How the sharded Muon tests (test_muon_sharded, test_muon_blocks,
// comm/test_muon_sharded_step) split a tensor over ranks, as FSDP2's
// Shard(0) and DTensor's Shard placements on a mesh do, and the exchanges
// between ranks simulated in one process.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "gradkit/ops/muon_sharded.h"

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

// A DTensor's blocks on a mesh: rank r (row-major mesh coordinates) holds,
// of a (batch, rows, cols) tensor, what each mesh dimension d in turn cuts
// of its side shard_sides[d] (0 batch, 1 rows, 2 cols; -1 replicated:
// nothing cut) with torch.chunk, as Shard(dim) does.
inline std::vector<MatrixBlock> mesh_blocks(const MatrixShape& s, const std::vector<int>& mesh,
                                            const std::vector<int>& shard_sides) {
  int ranks = 1;
  for (const int n : mesh) ranks *= n;
  std::vector<MatrixBlock> out;
  for (int r = 0; r < ranks; ++r) {
    std::array<int64_t, 3> lo = {0, 0, 0}, hi = {s.batch, s.rows, s.cols};
    int rest = r, stride = ranks;
    for (size_t d = 0; d < mesh.size(); ++d) {
      stride /= mesh[d];
      const int coordinate = rest / stride;
      rest %= stride;
      if (shard_sides[d] < 0) continue;
      const auto side = static_cast<size_t>(shard_sides[d]);
      const int64_t n = hi[side] - lo[side], each = (n + mesh[d] - 1) / mesh[d];
      const int64_t first = lo[side] + std::min<int64_t>(coordinate * each, n);
      hi[side] = lo[side] + std::min<int64_t>((coordinate + 1) * each, n);
      lo[side] = first;
    }
    out.push_back({lo[0], hi[0] - lo[0], lo[1], hi[1] - lo[1], lo[2], hi[2] - lo[2]});
  }
  return out;
}

// A block's elements of a whole (batch, rows, cols) tensor, in the block's
// order, and back.
inline std::vector<double> block_of(const std::vector<double>& v, const MatrixShape& s, const MatrixBlock& b) {
  std::vector<double> out;
  for (int64_t m = b.batch_first; m < b.batch_first + b.batches; ++m)
    for (int64_t i = b.row_first; i < b.row_first + b.rows; ++i)
      for (int64_t j = b.col_first; j < b.col_first + b.cols; ++j)
        out.push_back(v[static_cast<size_t>((m * s.rows + i) * s.cols + j)]);
  return out;
}
inline void put_block(std::vector<double>& v, const MatrixShape& s, const MatrixBlock& b,
                      const std::vector<double>& values) {
  size_t k = 0;
  for (int64_t m = b.batch_first; m < b.batch_first + b.batches; ++m)
    for (int64_t i = b.row_first; i < b.row_first + b.rows; ++i)
      for (int64_t j = b.col_first; j < b.col_first + b.cols; ++j)
        v[static_cast<size_t>((m * s.rows + i) * s.cols + j)] = values[k++];
}

// What an all-to-all of one bucket does among simulated ranks (each with a
// MuonShardedPlan `plan`): section r of each rank's `from` buffer lands in
// section (the sender) of rank r's `to` buffer.
template <class Rank>
void all_to_all(std::vector<Rank>& ranks, size_t bucket, bool back) {
  const size_t n = ranks.size();
  std::vector<std::vector<uint16_t>> sent(n);
  for (size_t s = 0; s < n; ++s) {
    const TensorView from = back ? ranks[s].plan.owner_buffer(bucket) : ranks[s].plan.shard_buffer(bucket);
    sent[s].resize(static_cast<size_t>(from.numel));
    copy_to_host(sent[s].data(), from.data, sent[s].size() * 2, from.device);
  }
  for (size_t r = 0; r < n; ++r) {
    const TensorView to = back ? ranks[r].plan.shard_buffer(bucket) : ranks[r].plan.owner_buffer(bucket);
    std::vector<uint16_t> received;
    for (size_t s = 0; s < n; ++s) {
      const auto counts = back ? ranks[s].plan.owner_counts(bucket) : ranks[s].plan.shard_counts(bucket);
      const auto expected = back ? ranks[r].plan.shard_counts(bucket) : ranks[r].plan.owner_counts(bucket);
      ASSERT_EQ(counts[r], expected[s]) << "rank " << s << " sends rank " << r << " what it expects";
      int64_t at = 0;
      for (size_t k = 0; k < r; ++k) at += counts[k];
      received.insert(received.end(), sent[s].begin() + at, sent[s].begin() + at + counts[r]);
    }
    ASSERT_EQ(static_cast<int64_t>(received.size()), to.numel);
    if (!received.empty()) copy_from_host(to.data, to.device, received.data(), received.size() * 2);
  }
}

// Every part for all buckets at once, each bucket exchanged between two.
template <class Rank>
void sharded_step(std::vector<Rank>& ranks, const MuonStepInputs& in = {}) {
  const size_t buckets = ranks[0].plan.num_buckets();
  for (Rank& r : ranks) r.plan.momentum(in);
  for (size_t k = 0; k < buckets; ++k) all_to_all(ranks, k, false);
  for (Rank& r : ranks) r.plan.orthogonalize(in);
  for (size_t k = 0; k < buckets; ++k) all_to_all(ranks, k, true);
  for (Rank& r : ranks) r.plan.update(in);
}

}  // namespace gradkit::test
