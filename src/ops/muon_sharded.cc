// MuonShardedPlan: validate the shards and their splits or blocks, give each
// matrix an owner, lay out the two exchange buffers, and run the step's
// three parts over this rank's pieces and its owned matrices (docs/ops.md,
// "muon_step over shards").
#include "gradkit/ops/muon_sharded.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <tuple>

#include "spec/muon.h"
#include "gradkit/core/error.h"
#include "ops/muon_common.h"

namespace gradkit {
namespace {

using namespace muon_detail;

constexpr std::string_view kOp = "muon_sharded_step";
constexpr int kMomentum = 0, kOrthogonalize = 1, kUpdate = 2;

// Newton-Schulz multiplications of one iteration on a rows x cols matrix:
// 4 m^2 k + 2 m^3 with m the smaller side (the owners' balance).
double ns_flops(int64_t rows, int64_t cols) {
  const auto m = static_cast<double>(std::min(rows, cols)), k = static_cast<double>(std::max(rows, cols));
  return 4 * m * m * k + 2 * m * m * m;
}

std::string shape_text(const MatrixShape& s) {
  std::string text = "(";
  for (const int64_t side : {s.batch, s.rows, s.cols}) text.append(text.size() > 1 ? ", " : "").append(std::to_string(side));
  return text.append(")");
}

// The shape's sides are >= 1 and it has at most 2^62 elements.
void check_shape(size_t i, const MatrixShape& s) {
  if (s.batch < 1 || s.rows < 1 || s.cols < 1) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, indexed("shapes", i),
                         "is " + shape_text(s) + "; expected batch, rows and cols each >= 1");
  }
  constexpr int64_t kMost = int64_t{1} << 62;
  if (s.rows > kMost / s.cols || s.batch > kMost / (s.rows * s.cols)) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, indexed("shapes", i),
                         "is " + shape_text(s) + "; expected at most 2^62 elements");
  }
}

// The splits run from 0 to batch * rows without going down; this rank's
// shard holds its rows' elements.
void check_splits(size_t i, const MatrixShape& s, std::span<const int64_t> splits, int32_t rank, int64_t numel) {
  const int64_t rows = s.batch * s.rows;
  const std::string where = "row_splits[" + std::to_string(i) + "]";
  if (splits.front() != 0 || splits.back() != rows) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, where,
                         "runs from " + std::to_string(splits.front()) + " to " + std::to_string(splits.back()) +
                             ", expected 0 to the tensor's " + std::to_string(rows) + " rows (shapes[" +
                             std::to_string(i) + "] " + shape_text(s) + ")");
  }
  for (size_t r = 0; r + 1 < splits.size(); ++r) {
    if (splits[r + 1] < splits[r]) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, where,
                           "goes down at rank " + std::to_string(r) + " (" + std::to_string(splits[r]) + " to " +
                               std::to_string(splits[r + 1]) + "); expected non-decreasing row boundaries");
    }
  }
  const auto r = static_cast<size_t>(rank);
  const int64_t expected = (splits[r + 1] - splits[r]) * s.cols;
  if (numel != expected) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, indexed("params", i),
                         "has " + std::to_string(numel) + " elements, expected this rank's rows " +
                             std::to_string(splits[r]) + " to " + std::to_string(splits[r + 1]) + " of " +
                             std::to_string(s.cols) + " columns (" + std::to_string(expected) + ")");
  }
}

std::string block_text(const MatrixBlock& b) {
  const auto range = [](int64_t first, int64_t count) {
    std::string text = "[";
    return text.append(std::to_string(first)).append(", ").append(std::to_string(first + count)).append(")");
  };
  return "matrices " + range(b.batch_first, b.batches) + ", rows " + range(b.row_first, b.rows) + ", columns " +
         range(b.col_first, b.cols);
}

// Each block lies inside the tensor; this rank's shard holds its block's
// elements; the blocks tile the tensor (their elements add up to its, and
// no two non-empty blocks meet), so each element has one rank.
void check_blocks(size_t i, const MatrixShape& s, std::span<const MatrixBlock> blocks, int32_t rank, int64_t numel) {
  const auto where = [&](size_t r) {
    return "blocks[" + std::to_string(i * blocks.size() + r) + "] (tensor " + std::to_string(i) + ", rank " +
           std::to_string(r) + ")";
  };
  const auto inside = [](int64_t first, int64_t count, int64_t side) {
    return first >= 0 && count >= 0 && first <= side && count <= side - first;
  };
  int64_t total = 0;
  for (size_t r = 0; r < blocks.size(); ++r) {
    const MatrixBlock& b = blocks[r];
    if (!inside(b.batch_first, b.batches, s.batch) || !inside(b.row_first, b.rows, s.rows) ||
        !inside(b.col_first, b.cols, s.cols)) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, where(r),
                           "is " + block_text(b) + "; expected a block inside shapes[" + std::to_string(i) + "] " +
                               shape_text(s) + " (firsts and counts >= 0, first + count <= the side)");
    }
    total += b.numel();
  }
  const MatrixBlock& mine = blocks[static_cast<size_t>(rank)];
  if (numel != mine.numel()) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, indexed("params", i),
                         "has " + std::to_string(numel) + " elements, expected this rank's block (" + block_text(mine) +
                             ": " + std::to_string(mine.numel()) + ")");
  }
  const auto meet = [](int64_t a, int64_t n, int64_t b, int64_t m) { return a < b + m && b < a + n; };
  for (size_t r = 0; r < blocks.size(); ++r) {
    const MatrixBlock& a = blocks[r];
    for (size_t q = r + 1; q < blocks.size() && a.numel() > 0; ++q) {
      const MatrixBlock& b = blocks[q];
      if (b.numel() > 0 && meet(a.batch_first, a.batches, b.batch_first, b.batches) &&
          meet(a.row_first, a.rows, b.row_first, b.rows) && meet(a.col_first, a.cols, b.col_first, b.cols)) {
        throw_argument_error(ErrorCode::invalid_argument, kOp, where(q),
                             "is " + block_text(b) + ", which overlaps " + where(r) + " (" + block_text(a) +
                                 "); expected blocks that hold each element once (a replicated tensor goes to "
                                 "the ranks of one copy)");
      }
    }
  }
  const int64_t elements = s.batch * s.rows * s.cols;
  if (total != elements) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "blocks[" + std::to_string(i * blocks.size()) + "...]",
                         "cover " + std::to_string(total) + " of tensor " + std::to_string(i) + "'s " +
                             std::to_string(elements) + " elements (shapes[" + std::to_string(i) + "] " +
                             shape_text(s) + "); expected the ranks' blocks to cover every element");
  }
}

// Each matrix to the rank with the fewest FLOPs so far, largest first (the
// lowest rank on a tie), or to the rank that holds all of it (`holders`,
// -1 where none does) while that rank's FLOPs with the matrix stay within
// its fair share (the total over the ranks) or are at most the fewest plus
// the matrix's: the same answer on every rank. Expert stacks split by
// experts thus stay where they are, each rank orthogonalising its own with
// nothing to send, and a holder is passed over only where keeping the
// matrix would leave the ranks further apart than the matrix costs. A
// class of many equal matrices is dealt out over the ranks, so an exchange
// bucket of such classes gives every owner a share of its work (a class of
// fewer matrices than ranks cannot be). Giving classes whole to owners
// (twice the batch) makes the products no faster and the bucketed step
// slower, a bucket owned by one rank holding up the other (measured:
// bench/log/2026-11-26.md, "Muon's exchanges in buckets").
std::vector<int32_t> assign_owners(std::span<const double> flops, std::span<const int32_t> holders, int32_t ranks) {
  std::vector<size_t> order(flops.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return flops[a] > flops[b]; });
  // FLOPs are whole numbers far below 2^53: the sums are exact, the same on every rank.
  const double share = std::accumulate(flops.begin(), flops.end(), 0.0) / static_cast<double>(ranks);
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  std::vector<int32_t> owners(flops.size());
  for (const size_t m : order) {
    auto pick = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    const int32_t holder = holders[m];
    if (holder >= 0) {
      const double held = load[static_cast<size_t>(holder)];
      if (held + flops[m] <= share || held <= load[pick] + flops[m]) pick = static_cast<size_t>(holder);
    }
    owners[m] = static_cast<int32_t>(pick);
    load[pick] += flops[m];
  }
  return owners;
}

// Each batch's bucket: the batches' shape classes (one shape, one group),
// in the order they first appear, cut into at most `buckets` runs of about
// equal Newton-Schulz FLOPs (a class at the run its FLOPs' middle falls
// in); runs left empty are dropped. `flops` gets each bucket's FLOPs.
std::vector<size_t> bucket_batches(std::span<const MatrixBatch> batches, std::span<const double> batch_flops,
                                   int32_t buckets, std::vector<double>& flops) {
  std::map<std::tuple<int64_t, int64_t, int32_t>, size_t> class_of;
  std::vector<double> class_flops;
  std::vector<size_t> batch_class;
  for (size_t b = 0; b < batches.size(); ++b) {
    const auto [it, added] =
        class_of.try_emplace(std::make_tuple(batches[b].rows, batches[b].cols, batches[b].group), class_flops.size());
    if (added) class_flops.push_back(0.0);
    class_flops[it->second] += batch_flops[b];
    batch_class.push_back(it->second);
  }
  // More runs than classes would stay empty: no more are made (a huge count asks for nothing).
  const size_t runs = std::clamp<size_t>(class_flops.size(), 1, static_cast<size_t>(buckets));
  const double total = std::accumulate(class_flops.begin(), class_flops.end(), 0.0);
  std::vector<size_t> class_bucket;
  double before = 0;
  for (const double f : class_flops) {
    const double middle = total > 0 ? (before + f / 2) / total : 0.0;
    class_bucket.push_back(std::min(runs - 1, static_cast<size_t>(middle * static_cast<double>(runs))));
    before += f;
  }
  // Renumber the runs that hold a class 0, 1, ...: the buckets.
  std::vector<size_t> renumbered(runs, 0);
  size_t used = 0;
  for (size_t c = 0; c < class_bucket.size(); ++c) {
    if (c == 0 || class_bucket[c] != class_bucket[c - 1]) renumbered[class_bucket[c]] = used++;
  }
  flops.assign(std::max<size_t>(used, 1), 0.0);
  std::vector<size_t> out;
  for (size_t b = 0; b < batches.size(); ++b) {
    out.push_back(renumbered[class_bucket[batch_class[b]]]);
    flops[out.back()] += batch_flops[b];
  }
  return out;
}

// A tensor's pieces as the ranks hold them: rows (row_splits) or blocks.
struct TensorPieces {
  MatrixShape shape;
  std::span<const int64_t> splits;      // ranks + 1, or empty
  std::span<const MatrixBlock> blocks;  // ranks, where splits is empty

  // Rank r's piece of matrix m (its place in the matrix; `at` 0).
  spec::MuonPiece piece(int64_t m, size_t r) const {
    if (!splits.empty()) {
      const int64_t begin = m * shape.rows, end = begin + shape.rows;
      const int64_t lo = std::clamp(splits[r], begin, end), hi = std::clamp(splits[r + 1], begin, end);
      return {lo - begin, hi - lo, 0, shape.cols, 0};
    }
    const MatrixBlock& b = blocks[r];
    if (b.numel() == 0 || m < b.batch_first || m >= b.batch_first + b.batches) return {0, 0, 0, 0, 0};
    return {b.row_first, b.rows, b.col_first, b.cols, 0};
  }
  // Where rank r's piece of matrix m begins in its shard.
  int64_t shard_first(int64_t m, size_t r) const {
    if (!splits.empty()) return (std::clamp(splits[r], m * shape.rows, (m + 1) * shape.rows) - splits[r]) * shape.cols;
    const MatrixBlock& b = blocks[r];
    return (m - b.batch_first) * b.rows * b.cols;
  }
  // The rank whose piece is all of matrix m, or -1.
  int32_t holder(int64_t m, size_t ranks) const {
    for (size_t r = 0; r < ranks; ++r) {
      const spec::MuonPiece p = piece(m, r);
      if (p.rows * p.width == shape.rows * shape.cols) return static_cast<int32_t>(r);
    }
    return -1;
  }
};

int64_t elements(const spec::MuonPiece& p) { return p.rows * p.width; }

// Whether a matrix's pieces (one per rank) are whole rows, each beginning
// where the one before ends; if so, each empty one is placed there too, so
// that row_piece_holding's scan passes it.
bool as_rows(std::span<spec::MuonPiece> pieces, int64_t cols) {
  int64_t end = 0;
  for (const spec::MuonPiece& p : pieces) {
    if (elements(p) == 0) continue;
    if (p.col != 0 || p.width != cols || p.row != end) return false;
    end += p.rows;
  }
  end = 0;
  for (spec::MuonPiece& p : pieces) {
    if (elements(p) == 0) p.row = end;
    end = p.row + p.rows;
  }
  return true;
}

}  // namespace

MuonShardedPlan::MuonShardedPlan(const MuonShardedTensors& t, std::span<const MuonHyperparameters> hyperparameters,
                                 std::span<const int32_t> groups, MuonPlanOptions options)
    : rank_(t.rank), ranks_(t.ranks), options_(options) {
  if (hyperparameters.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "hyperparameters", "is empty; expected one entry per group");
  }
  for (size_t i = 0; i < hyperparameters.size(); ++i) {
    validate(hyperparameters[i], kOp, indexed("hyperparameters", i));
    check_sharded_recipe(hyperparameters[i], kOp, indexed("hyperparameters", i));
  }
  check_value(options.streams >= 1, kOp, "options.streams", options.streams, "a count >= 1");
  check_value(options.buckets >= 1, kOp, "options.buckets", options.buckets, "a count >= 1");
  check_value(t.ranks >= 1, kOp, "ranks", t.ranks, "a count >= 1");
  check_value(t.rank >= 0 && t.rank < t.ranks, kOp, "rank", t.rank, "a rank in [0, ranks)");
  const size_t n = t.params.size(), stride = static_cast<size_t>(t.ranks) + 1;
  if (t.shapes.size() != n) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, "shapes",
                         "has " + std::to_string(t.shapes.size()) + " entries, expected one per parameter (" +
                             std::to_string(n) + ")");
  }
  const auto R = static_cast<size_t>(t.ranks);
  const bool by_blocks = !t.blocks.empty();
  if (by_blocks && !t.row_splits.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "row_splits, blocks",
                         "are both given; expected one of them (a tensor's rows, or its blocks)");
  }
  if (!by_blocks && t.row_splits.size() != n * stride) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, "row_splits",
                         "has " + std::to_string(t.row_splits.size()) + " entries, expected ranks + 1 = " +
                             std::to_string(stride) + " per parameter (" + std::to_string(n * stride) +
                             "), or blocks instead");
  }
  if (by_blocks && t.blocks.size() != n * R) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, "blocks",
                         "has " + std::to_string(t.blocks.size()) + " entries, expected ranks = " + std::to_string(R) +
                             " per parameter (" + std::to_string(n * R) + ")");
  }
  const std::vector<PlanList> lists = {{"params", t.params, true}, {"grads", t.grads, false},
                                       {"momentum", t.momentum, true}};
  all_ = MultiTensorPlan(kOp, lists, MultiTensorPlan::kDefaultChunkElements, groups,
                         static_cast<int32_t>(hyperparameters.size()));
  if (!all_.empty()) check_dtypes(kOp, all_);
  std::vector<TensorPieces> tensors;
  for (size_t i = 0; i < n; ++i) {
    check_shape(i, t.shapes[i]);
    if (!by_blocks) {
      const auto splits = t.row_splits.subspan(i * stride, stride);
      check_splits(i, t.shapes[i], splits, t.rank, t.params[i].numel);
      tensors.push_back({t.shapes[i], splits, {}});
    } else {
      const auto blocks = t.blocks.subspan(i * R, R);
      check_blocks(i, t.shapes[i], blocks, t.rank, t.params[i].numel);
      tensors.push_back({t.shapes[i], {}, blocks});
    }
  }

  // Every matrix, its owner, and the batches: one shape, one group, one
  // owner, in the global order (the same on every rank).
  std::vector<double> flops;
  std::vector<int32_t> holders;
  for (size_t i = 0; i < n; ++i) {
    first_matrix_.push_back(static_cast<int64_t>(flops.size()));
    flops.insert(flops.end(), static_cast<size_t>(t.shapes[i].batch), ns_flops(t.shapes[i].rows, t.shapes[i].cols));
    for (int64_t m = 0; m < t.shapes[i].batch; ++m) holders.push_back(tensors[i].holder(m, R));
  }
  first_matrix_.push_back(static_cast<int64_t>(flops.size()));
  owners_ = assign_owners(flops, holders, t.ranks);
  for (size_t m = 0; m < flops.size(); ++m) {
    if (owners_[m] == t.rank) owned_flops_ += flops[m];
  }
  const std::vector<MatrixBatch> batches = batch_matrices(t.shapes, groups, owners_);
  std::vector<double> batch_flops;
  for (const MatrixBatch& b : batches) {
    batch_flops.push_back(static_cast<double>(b.sources.size()) * ns_flops(b.rows, b.cols));
  }
  const std::vector<size_t> bucket_of = bucket_batches(batches, batch_flops, options.buckets, bucket_flops_);
  buckets_.assign(owners_.size(), 0);
  for (size_t b = 0; b < batches.size(); ++b) {
    for (const auto& [i, m] : batches[b].sources) {
      buckets_[static_cast<size_t>(first_matrix_[static_cast<size_t>(i)] + m)] = bucket_of[b];
    }
  }

  // The exchange buffers, bucket by bucket: shard_buffer's section (k, o)
  // holds this rank's pieces of rank o's matrices of bucket k, owner_buffer's
  // section (k, s) rank s's pieces of this rank's matrices of bucket k, both
  // in the global batch order.
  const auto me = static_cast<size_t>(t.rank);
  shard_counts_.assign(num_buckets() * R, 0);
  owner_counts_.assign(num_buckets() * R, 0);
  for (size_t b = 0; b < batches.size(); ++b) {
    const size_t section = bucket_of[b] * R;
    for (const auto& [i, m] : batches[b].sources) {
      const TensorPieces& held = tensors[static_cast<size_t>(i)];
      shard_counts_[section + static_cast<size_t>(batches[b].owner)] += elements(held.piece(m, me));
      if (batches[b].owner == t.rank) {
        for (size_t s = 0; s < R; ++s) owner_counts_[section + s] += elements(held.piece(m, s));
      }
    }
  }
  shard_at_.assign(shard_counts_.size() + 1, 0);
  owner_at_.assign(owner_counts_.size() + 1, 0);
  std::inclusive_scan(shard_counts_.begin(), shard_counts_.end(), shard_at_.begin() + 1);
  std::inclusive_scan(owner_counts_.begin(), owner_counts_.end(), owner_at_.begin() + 1);
  std::vector<int64_t> shard_at(shard_at_.begin(), shard_at_.end() - 1);
  std::vector<int64_t> owner_at(owner_at_.begin(), owner_at_.end() - 1);
  const auto bf16_bytes = [](int64_t elements) { return std::max<size_t>(256, static_cast<size_t>(elements) * 2); };
  shard_buffer_ = Buffer(device(), bf16_bytes(shard_at_.back()));
  owner_buffer_ = Buffer(device(), bf16_bytes(owner_at_.back()));
  const TensorView shard_all = shard_buffer_.view(DType::bf16, 0, shard_at_.back());

  std::vector<spec::MuonPiece> pieces;
  std::vector<size_t> owned_bytes;
  for (size_t k = 0; k < batches.size(); ++k) {
    const MatrixBatch& b = batches[k];
    const size_t section = bucket_of[k] * R;
    // This rank's pieces of the batch's matrices, and their place in shard_buffer.
    MuonPlan::Batch rows_batch{{}, static_cast<int64_t>(b.sources.size()), b.rows, b.cols, b.group, b.sources};
    std::vector<RowSlice> slices;
    std::vector<TensorView> x;
    for (const auto& [i, m] : b.sources) {
      const TensorPieces& held = tensors[static_cast<size_t>(i)];
      const int64_t count = elements(held.piece(m, me));
      int64_t& at = shard_at[section + static_cast<size_t>(b.owner)];
      slices.push_back({i, count ? held.shard_first(m, me) : 0, count});
      x.push_back(slice(shard_all, at, count));
      at += count;
    }
    const std::vector<TensorView> p = slice_views(slices, t.params), g = slice_views(slices, t.grads),
                                  mo = slice_views(slices, t.momentum);
    const std::vector<PlanList> row_lists = {{"params", p, true}, {"grads", g, false}, {"momentum", mo, true},
                                             {"shard_buffer", x, true}};
    rows_batch.plan = MultiTensorPlan(kOp, row_lists);
    rows_.push_back(std::move(rows_batch));
    rows_bucket_.push_back(bucket_of[k]);
    row_slices_.push_back(std::move(slices));
    if (b.owner != t.rank) continue;
    // An owned batch: every rank's piece of each matrix in owner_buffer.
    MuonPlan::Batch owned{{}, static_cast<int64_t>(b.sources.size()), b.rows, b.cols, b.group, b.sources};
    owned_pieces_.push_back(pieces.size());
    bool by_rows = true;
    for (const auto& [i, m] : b.sources) {
      const size_t first = pieces.size();
      for (size_t s = 0; s < R; ++s) {
        spec::MuonPiece piece = tensors[static_cast<size_t>(i)].piece(m, s);
        piece.at = owner_at[section + s];
        owner_at[section + s] += elements(piece);
        pieces.push_back(piece);
      }
      by_rows = as_rows(std::span(pieces).subspan(first, R), b.cols) && by_rows;
    }
    owned_by_rows_.push_back(by_rows);
    const int64_t elements = b.rows * b.cols, chunk = MultiTensorPlan::kDefaultChunkElements;
    const auto chunks = static_cast<size_t>(owned.count * ((elements + chunk - 1) / chunk));
    owned_bytes.push_back(device().is_cuda()
                              ? spec::muon_cuda_workspace_bytes(owned.count, b.rows, b.cols, chunks)
                              : spec::muon_cpu_workspace_bytes(owned.count, b.rows, b.cols, chunks));
    owned_.push_back(std::move(owned));
    owned_bucket_.push_back(bucket_of[k]);
  }
  Concurrency together = plan_concurrency(device(), owned_bytes, options.streams);
  offsets_ = std::move(together.offsets);
  lanes_ = together.lanes;
  workspace_ = Buffer(device(), std::max<size_t>(together.workspace, 256));
  // An owned batch's plan lists its matrices where the workspace holds them
  // (its chunks are those of MuonPlan's batch: the same norms, bit for bit).
  const DType dtype = spec::muon_workspace_dtype(device());
  for (size_t b = 0; b < owned_.size(); ++b) {
    MuonPlan::Batch& owned = owned_[b];
    const size_t base = offsets_.empty() ? 0 : offsets_[b];
    const int64_t elements = owned.rows * owned.cols;
    std::vector<TensorView> matrices;
    for (int64_t j = 0; j < owned.count; ++j) {
      matrices.push_back(workspace_.view(dtype, base + static_cast<size_t>(j * elements) * dtype_size(dtype), elements));
    }
    const std::vector<PlanList> owned_lists = {{"matrices", matrices, true}};
    owned.plan = MultiTensorPlan(kOp, owned_lists);
  }
  pieces_ = Buffer(device(), std::max<size_t>(256, pieces.size() * sizeof(spec::MuonPiece)));
  if (!pieces.empty()) copy_from_host(pieces_.data(), device(), pieces.data(), pieces.size() * sizeof(spec::MuonPiece));
  hyper_.set(kOp, hyperparameters, device());
  // Buckets' products at once when no two owned batches share a workspace
  // or a lane (b % lanes_); else one side stream takes them in order.
  at_once_ = device().is_cuda() && !offsets_.empty() && owned_.size() <= static_cast<size_t>(lanes_);
  if (device().is_cuda()) {
    rows_gemm_ = spec::muon_cuda_gemm(device(), 0, false);
    update_gemm_ = spec::muon_cuda_gemm(device(), 0, false);
    const auto buckets = static_cast<int>(num_buckets());
    owned_gemm_ = spec::muon_cuda_gemm(device(), lanes_, true, at_once_ ? buckets : 1, buckets);
    spec::muon_cuda_prepare(owned_gemm_.get(), launches({}, kOrthogonalize, kAllBuckets));
  }
}

std::vector<TensorView> MuonShardedPlan::slice_views(std::span<const RowSlice> slices,
                                                     std::span<const TensorView> tensors) {
  std::vector<TensorView> views;
  views.reserve(slices.size());
  for (const RowSlice& r : slices) views.push_back(slice(tensors[static_cast<size_t>(r.tensor)], r.first, r.elements));
  return views;
}

size_t MuonShardedPlan::checked(size_t bucket) const {
  if (bucket >= num_buckets()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "bucket",
                         "is " + std::to_string(bucket) +
                             (num_buckets() == 0 ? std::string(", expected a bucket; this plan was made empty")
                                                 : ", expected one of the plan's " + std::to_string(num_buckets()) +
                                                       " buckets (0 to " + std::to_string(num_buckets() - 1) + ")"));
  }
  return bucket;
}

TensorView MuonShardedPlan::shard_buffer(size_t bucket) const {
  const size_t R = static_cast<size_t>(ranks_), first = checked(bucket) * R;
  return shard_buffer_.view(DType::bf16, static_cast<size_t>(shard_at_[first]) * 2,
                            shard_at_[first + R] - shard_at_[first]);
}

TensorView MuonShardedPlan::owner_buffer(size_t bucket) const {
  const size_t R = static_cast<size_t>(ranks_), first = checked(bucket) * R;
  return owner_buffer_.view(DType::bf16, static_cast<size_t>(owner_at_[first]) * 2,
                            owner_at_[first + R] - owner_at_[first]);
}

std::span<const int64_t> MuonShardedPlan::shard_counts(size_t bucket) const {
  return std::span(shard_counts_).subspan(checked(bucket) * static_cast<size_t>(ranks_), static_cast<size_t>(ranks_));
}

std::span<const int64_t> MuonShardedPlan::owner_counts(size_t bucket) const {
  return std::span(owner_counts_).subspan(checked(bucket) * static_cast<size_t>(ranks_), static_cast<size_t>(ranks_));
}

double MuonShardedPlan::bucket_flops(size_t bucket) const { return bucket_flops_[checked(bucket)]; }

size_t MuonShardedPlan::matrix_index(size_t tensor, int64_t matrix) const {
  if (tensor + 1 >= first_matrix_.size() || matrix < 0 || first_matrix_[tensor] + matrix >= first_matrix_[tensor + 1]) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "tensor, matrix",
                         "is (" + std::to_string(tensor) + ", " + std::to_string(matrix) +
                             "), expected a tensor of the plan and one of its matrices");
  }
  return static_cast<size_t>(first_matrix_[tensor] + matrix);
}

int32_t MuonShardedPlan::owner(size_t tensor, int64_t matrix) const { return owners_[matrix_index(tensor, matrix)]; }

size_t MuonShardedPlan::bucket(size_t tensor, int64_t matrix) const { return buckets_[matrix_index(tensor, matrix)]; }

std::vector<spec::MuonLaunch> MuonShardedPlan::launches(const MuonStepInputs& in, int stage, size_t bucket) const {
  std::vector<spec::MuonLaunch> out;
  const auto add = [&](const MuonPlan::Batch& batch, spec::MuonStage s) -> spec::MuonLaunch& {
    const auto group = static_cast<size_t>(batch.group);
    spec::MuonLaunch l{&batch, &hyper_.host()[group], hyper_.on(device()) + group, nullptr, nullptr,
                          in.found_inf, in.grad_scale, in.grad_scale_device, options_.split_from};
    l.stage = s;
    l.ranks = ranks_;
    return out.emplace_back(l);
  };
  const auto wanted = [&](size_t in_bucket) { return bucket == kAllBuckets || in_bucket == bucket; };
  if (stage == kOrthogonalize) {
    const auto* pieces = static_cast<const spec::MuonPiece*>(pieces_.data());
    for (size_t b = 0; b < owned_.size(); ++b) {
      if (!wanted(owned_bucket_[b])) continue;
      spec::MuonLaunch& l = add(owned_[b], spec::MuonStage::orthogonalize);
      l.gemm = owned_gemm_.get();
      l.workspace = static_cast<unsigned char*>(workspace_.data()) + (offsets_.empty() ? 0 : offsets_[b]);
      if (!offsets_.empty()) l.lane = static_cast<int>(b % static_cast<size_t>(lanes_));
      l.pieces = pieces + owned_pieces_[b];
      l.pieces_by_rows = owned_by_rows_[b] != 0;
      l.exchange = owner_buffer_.data();
    }
    return out;
  }
  for (size_t b = 0; b < rows_.size(); ++b) {
    if (!rows_[b].plan.empty() && wanted(rows_bucket_[b])) {
      add(rows_[b], stage == kMomentum ? spec::MuonStage::momentum : spec::MuonStage::update);
    }
  }
  return out;
}

void MuonShardedPlan::validate_inputs(const MuonStepInputs& in) const { check_step_inputs(kOp, in, device()); }

void MuonShardedPlan::run(int stage, size_t bucket, const MuonStepInputs& in, Stream stream) const {
  validate_inputs(in);
  const std::vector<spec::MuonLaunch> all = launches(in, stage, bucket);
  if (all.empty()) return;
  if (!device().is_cuda()) {
    for (const spec::MuonLaunch& launch : all) spec::muon_cpu(launch);
    return;
  }
  // A recording per bucket, and one for every bucket at once (the last slot).
  const size_t slot = bucket == kAllBuckets ? num_buckets() : bucket;
  const void* gemm = stage == kMomentum ? rows_gemm_.get() : stage == kUpdate ? update_gemm_.get() : owned_gemm_.get();
  const bool concurrent = stage == kOrthogonalize && !offsets_.empty();
  spec::muon_cuda_step(gemm, all, concurrent, options_.graphs, stream, slot);
}

void MuonShardedPlan::momentum(size_t bucket, const MuonStepInputs& in, Stream stream) const {
  run(kMomentum, checked(bucket), in, stream);
}
void MuonShardedPlan::orthogonalize(size_t bucket, const MuonStepInputs& in, Stream stream) const {
  run(kOrthogonalize, checked(bucket), in, stream);
}
void MuonShardedPlan::update(size_t bucket, const MuonStepInputs& in, Stream stream) const {
  run(kUpdate, checked(bucket), in, stream);
}
void MuonShardedPlan::orthogonalize_beside(size_t bucket, const MuonStepInputs& in, Stream stream) const {
  checked(bucket);
  if (!device().is_cuda()) return run(kOrthogonalize, bucket, in, stream);
  validate_inputs(in);
  spec::muon_cuda_beside(owned_gemm_.get(), launches(in, kOrthogonalize, bucket), !offsets_.empty(),
                            options_.graphs, stream, bucket, at_once_ ? bucket : 0);
}
void MuonShardedPlan::join(size_t bucket, Stream stream) const {
  checked(bucket);
  if (device().is_cuda()) spec::muon_cuda_join(owned_gemm_.get(), stream, bucket);
}
void MuonShardedPlan::momentum(const MuonStepInputs& in, Stream stream) const {
  run(kMomentum, kAllBuckets, in, stream);
}
void MuonShardedPlan::orthogonalize(const MuonStepInputs& in, Stream stream) const {
  run(kOrthogonalize, kAllBuckets, in, stream);
}
void MuonShardedPlan::update(const MuonStepInputs& in, Stream stream) const { run(kUpdate, kAllBuckets, in, stream); }

void MuonShardedPlan::set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters) {
  for (size_t i = 0; i < hyperparameters.size(); ++i)
    check_sharded_recipe(hyperparameters[i], kOp, indexed("hyperparameters", i));
  hyper_.set(kOp, hyperparameters, device());
}

void MuonShardedPlan::set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters, Stream stream) {
  for (size_t i = 0; i < hyperparameters.size(); ++i)
    check_sharded_recipe(hyperparameters[i], kOp, indexed("hyperparameters", i));
  hyper_.set_on(kOp, hyperparameters, device(), stream);
}

void MuonShardedPlan::set_grads(std::span<const TensorView> grads, Stream stream) {
  // The rows batches check the new gradients against shard_buffer (their
  // list 3) too: that check runs first, so that a refusal changes nothing.
  const auto* lo = static_cast<const unsigned char*>(shard_buffer_.data());
  const auto* hi = lo + shard_buffer_.bytes();
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto* at = static_cast<const unsigned char*>(grads[i].data);
    if (grads[i].numel > 0 && at < hi && at + grads[i].bytes() > lo) {
      throw_argument_error(ErrorCode::aliasing, kOp, indexed("grads", i),
                           "overlaps the plan's shard_buffer; expected gradients in memory of their own");
    }
  }
  all_.repoint(1, grads, stream);  // every other check, before any batch changes
  for (size_t b = 0; b < rows_.size(); ++b) rows_[b].plan.repoint(1, slice_views(row_slices_[b], grads), stream);
}

}  // namespace gradkit
