// MuonShardedPlan: validate the shards and their splits, give each matrix an
// owner, lay out the two exchange buffers, and run the step's three parts
// over this rank's rows and its owned matrices (docs/ops.md, "muon_step
// over row shards").
#include "gradkit/ops/muon_sharded.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>

#include "backend/muon.h"
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

// The shape's sides are >= 1 and it has at most 2^62 elements; the splits
// run from 0 to batch * rows without going down; this rank's shard holds
// its rows' elements.
void check_tensor(size_t i, const MatrixShape& s, std::span<const int64_t> splits, int32_t rank, int64_t numel) {
  if (s.batch < 1 || s.rows < 1 || s.cols < 1) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, indexed("shapes", i),
                         "is " + shape_text(s) + "; expected batch, rows and cols each >= 1");
  }
  constexpr int64_t kMost = int64_t{1} << 62;
  if (s.rows > kMost / s.cols || s.batch > kMost / (s.rows * s.cols)) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, indexed("shapes", i),
                         "is " + shape_text(s) + "; expected at most 2^62 elements");
  }
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

// Each matrix to the rank with the fewest FLOPs so far, largest first (the
// lowest rank on a tie): the same answer on every rank.
std::vector<int32_t> assign_owners(std::span<const double> flops, int32_t ranks) {
  std::vector<size_t> order(flops.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return flops[a] > flops[b]; });
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  std::vector<int32_t> owners(flops.size());
  for (const size_t m : order) {
    const auto least = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[m] = static_cast<int32_t>(least);
    load[least] += flops[m];
  }
  return owners;
}

// A tensor's rows as the ranks hold them.
struct TensorRows {
  MatrixShape shape;
  std::span<const int64_t> splits;  // ranks + 1
  // Rank r's rows of matrix m: its first row in the matrix and their count.
  std::pair<int64_t, int64_t> piece(int64_t m, size_t r) const {
    const int64_t begin = m * shape.rows, end = begin + shape.rows;
    const int64_t lo = std::clamp(splits[r], begin, end), hi = std::clamp(splits[r + 1], begin, end);
    return {lo - begin, hi - lo};
  }
};

}  // namespace

MuonShardedPlan::MuonShardedPlan(const MuonShardedTensors& t, std::span<const MuonHyperparameters> hyperparameters,
                                 std::span<const int32_t> groups, MuonPlanOptions options)
    : rank_(t.rank), ranks_(t.ranks), options_(options) {
  if (hyperparameters.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "hyperparameters", "is empty; expected one entry per group");
  }
  for (size_t i = 0; i < hyperparameters.size(); ++i) validate(hyperparameters[i], kOp, indexed("hyperparameters", i));
  check_value(options.streams >= 1, kOp, "options.streams", options.streams, "a count >= 1");
  check_value(t.ranks >= 1, kOp, "ranks", t.ranks, "a count >= 1");
  check_value(t.rank >= 0 && t.rank < t.ranks, kOp, "rank", t.rank, "a rank in [0, ranks)");
  const size_t n = t.params.size(), stride = static_cast<size_t>(t.ranks) + 1;
  if (t.shapes.size() != n) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, "shapes",
                         "has " + std::to_string(t.shapes.size()) + " entries, expected one per parameter (" +
                             std::to_string(n) + ")");
  }
  if (t.row_splits.size() != n * stride) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, "row_splits",
                         "has " + std::to_string(t.row_splits.size()) + " entries, expected ranks + 1 = " +
                             std::to_string(stride) + " per parameter (" + std::to_string(n * stride) + ")");
  }
  const std::vector<PlanList> lists = {{"params", t.params, true}, {"grads", t.grads, false},
                                       {"momentum", t.momentum, true}};
  all_ = MultiTensorPlan(kOp, lists, MultiTensorPlan::kDefaultChunkElements, groups,
                         static_cast<int32_t>(hyperparameters.size()));
  if (!all_.empty()) check_dtypes(kOp, all_);
  std::vector<TensorRows> tensors;
  for (size_t i = 0; i < n; ++i) {
    const auto splits = t.row_splits.subspan(i * stride, stride);
    check_tensor(i, t.shapes[i], splits, t.rank, t.params[i].numel);
    tensors.push_back({t.shapes[i], splits});
  }

  // Every matrix, its owner, and the batches: one shape, one group, one
  // owner, in the global order (the same on every rank).
  std::vector<double> flops;
  for (size_t i = 0; i < n; ++i) {
    first_matrix_.push_back(static_cast<int64_t>(flops.size()));
    flops.insert(flops.end(), static_cast<size_t>(t.shapes[i].batch), ns_flops(t.shapes[i].rows, t.shapes[i].cols));
  }
  first_matrix_.push_back(static_cast<int64_t>(flops.size()));
  owners_ = assign_owners(flops, t.ranks);
  for (size_t m = 0; m < flops.size(); ++m) {
    if (owners_[m] == t.rank) owned_flops_ += flops[m];
  }
  const std::vector<MatrixBatch> batches = batch_matrices(t.shapes, groups, owners_);

  // The exchange buffers: shard_buffer's section o holds this rank's rows
  // of rank o's matrices, owner_buffer's section s rank s's rows of this
  // rank's matrices, both in the global batch order.
  const auto R = static_cast<size_t>(t.ranks), me = static_cast<size_t>(t.rank);
  shard_counts_.assign(R, 0);
  owner_counts_.assign(R, 0);
  for (const MatrixBatch& b : batches) {
    for (const auto& [i, m] : b.sources) {
      const TensorRows& rows = tensors[static_cast<size_t>(i)];
      shard_counts_[static_cast<size_t>(b.owner)] += rows.piece(m, me).second * b.cols;
      if (b.owner == t.rank) {
        for (size_t s = 0; s < R; ++s) owner_counts_[s] += rows.piece(m, s).second * b.cols;
      }
    }
  }
  std::vector<int64_t> shard_at(R, 0), owner_at(R, 0);
  std::exclusive_scan(shard_counts_.begin(), shard_counts_.end(), shard_at.begin(), int64_t{0});
  std::exclusive_scan(owner_counts_.begin(), owner_counts_.end(), owner_at.begin(), int64_t{0});
  const auto bf16_bytes = [](int64_t elements) { return std::max<size_t>(256, static_cast<size_t>(elements) * 2); };
  shard_buffer_ = Buffer(device(), bf16_bytes(std::accumulate(shard_counts_.begin(), shard_counts_.end(), int64_t{0})));
  owner_buffer_ = Buffer(device(), bf16_bytes(std::accumulate(owner_counts_.begin(), owner_counts_.end(), int64_t{0})));
  const TensorView shard_all = shard_buffer();

  std::vector<backend::MuonPiece> pieces;
  std::vector<size_t> owned_bytes;
  for (const MatrixBatch& b : batches) {
    // This rank's rows of the batch's matrices, and their place in shard_buffer.
    MuonPlan::Batch rows_batch{{}, static_cast<int64_t>(b.sources.size()), b.rows, b.cols, b.group, b.sources};
    std::vector<RowSlice> slices;
    std::vector<TensorView> x;
    for (const auto& [i, m] : b.sources) {
      const TensorRows& rows = tensors[static_cast<size_t>(i)];
      const auto [first, count] = rows.piece(m, me);
      const int64_t elements = count * b.cols;
      slices.push_back({i, elements ? (m * b.rows + first - rows.splits[me]) * b.cols : 0, elements});
      x.push_back(slice(shard_all, shard_at[static_cast<size_t>(b.owner)], elements));
      shard_at[static_cast<size_t>(b.owner)] += elements;
    }
    const std::vector<TensorView> p = slice_views(slices, t.params), g = slice_views(slices, t.grads),
                                  mo = slice_views(slices, t.momentum);
    const std::vector<PlanList> row_lists = {{"params", p, true}, {"grads", g, false}, {"momentum", mo, true},
                                             {"shard_buffer", x, true}};
    rows_batch.plan = MultiTensorPlan(kOp, row_lists);
    rows_.push_back(std::move(rows_batch));
    row_slices_.push_back(std::move(slices));
    if (b.owner != t.rank) continue;
    // An owned batch: every rank's rows of each matrix in owner_buffer.
    MuonPlan::Batch owned{{}, static_cast<int64_t>(b.sources.size()), b.rows, b.cols, b.group, b.sources};
    owned_pieces_.push_back(pieces.size());
    for (const auto& [i, m] : b.sources) {
      for (size_t s = 0; s < R; ++s) {
        const auto [first, count] = tensors[static_cast<size_t>(i)].piece(m, s);
        pieces.push_back({first * b.cols, owner_at[s]});
        owner_at[s] += count * b.cols;
      }
    }
    const int64_t elements = b.rows * b.cols, chunk = MultiTensorPlan::kDefaultChunkElements;
    const auto chunks = static_cast<size_t>(owned.count * ((elements + chunk - 1) / chunk));
    owned_bytes.push_back(device().is_cuda()
                              ? backend::muon_cuda_workspace_bytes(owned.count, b.rows, b.cols, chunks)
                              : backend::muon_cpu_workspace_bytes(owned.count, b.rows, b.cols, chunks));
    owned_.push_back(std::move(owned));
  }
  Concurrency together = plan_concurrency(device(), owned_bytes, options.streams);
  offsets_ = std::move(together.offsets);
  lanes_ = together.lanes;
  workspace_ = Buffer(device(), std::max<size_t>(together.workspace, 256));
  // An owned batch's plan lists its matrices where the workspace holds them
  // (its chunks are those of MuonPlan's batch: the same norms, bit for bit).
  const DType dtype = backend::muon_workspace_dtype(device());
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
  pieces_ = Buffer(device(), std::max<size_t>(256, pieces.size() * sizeof(backend::MuonPiece)));
  if (!pieces.empty()) copy_from_host(pieces_.data(), device(), pieces.data(), pieces.size() * sizeof(backend::MuonPiece));
  hyper_.set(kOp, hyperparameters, device());
  if (device().is_cuda()) {
    rows_gemm_ = backend::muon_cuda_gemm(device(), 0, false);
    update_gemm_ = backend::muon_cuda_gemm(device(), 0, false);
    owned_gemm_ = backend::muon_cuda_gemm(device(), lanes_);
    backend::muon_cuda_prepare(owned_gemm_.get(), launches({}, kOrthogonalize));
  }
}

std::vector<TensorView> MuonShardedPlan::slice_views(std::span<const RowSlice> slices,
                                                     std::span<const TensorView> tensors) {
  std::vector<TensorView> views;
  views.reserve(slices.size());
  for (const RowSlice& r : slices) views.push_back(slice(tensors[static_cast<size_t>(r.tensor)], r.first, r.elements));
  return views;
}

TensorView MuonShardedPlan::shard_buffer() const {
  return shard_buffer_.view(DType::bf16, 0, std::accumulate(shard_counts_.begin(), shard_counts_.end(), int64_t{0}));
}

TensorView MuonShardedPlan::owner_buffer() const {
  return owner_buffer_.view(DType::bf16, 0, std::accumulate(owner_counts_.begin(), owner_counts_.end(), int64_t{0}));
}

int32_t MuonShardedPlan::owner(size_t tensor, int64_t matrix) const {
  if (tensor + 1 >= first_matrix_.size() || matrix < 0 || first_matrix_[tensor] + matrix >= first_matrix_[tensor + 1]) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "tensor, matrix",
                         "is (" + std::to_string(tensor) + ", " + std::to_string(matrix) +
                             "), expected a tensor of the plan and one of its matrices");
  }
  return owners_[static_cast<size_t>(first_matrix_[tensor] + matrix)];
}

std::vector<backend::MuonLaunch> MuonShardedPlan::launches(const MuonStepInputs& in, int stage) const {
  std::vector<backend::MuonLaunch> out;
  const auto add = [&](const MuonPlan::Batch& batch, backend::MuonStage s) -> backend::MuonLaunch& {
    const auto group = static_cast<size_t>(batch.group);
    backend::MuonLaunch l{&batch, &hyper_.host()[group], hyper_.on(device()) + group, nullptr, nullptr,
                          in.found_inf, in.grad_scale, in.grad_scale_device, options_.split_from};
    l.stage = s;
    l.ranks = ranks_;
    return out.emplace_back(l);
  };
  if (stage == kOrthogonalize) {
    const auto* pieces = static_cast<const backend::MuonPiece*>(pieces_.data());
    for (size_t b = 0; b < owned_.size(); ++b) {
      backend::MuonLaunch& l = add(owned_[b], backend::MuonStage::orthogonalize);
      l.gemm = owned_gemm_.get();
      l.workspace = static_cast<unsigned char*>(workspace_.data()) + (offsets_.empty() ? 0 : offsets_[b]);
      if (!offsets_.empty()) l.lane = static_cast<int>(b % static_cast<size_t>(lanes_));
      l.pieces = pieces + owned_pieces_[b];
      l.exchange = owner_buffer_.data();
    }
    return out;
  }
  for (const MuonPlan::Batch& batch : rows_) {
    if (!batch.plan.empty()) add(batch, stage == kMomentum ? backend::MuonStage::momentum : backend::MuonStage::update);
  }
  return out;
}

void MuonShardedPlan::validate_inputs(const MuonStepInputs& in) const { check_step_inputs(kOp, in, device()); }

namespace {

void run_part(const std::vector<backend::MuonLaunch>& all, const void* gemm, bool concurrent, bool graphs,
              Device device, Stream stream) {
  if (all.empty()) return;
  if (device.is_cuda()) {
    backend::muon_cuda_step(gemm, all, concurrent, graphs, stream);
  } else {
    for (const backend::MuonLaunch& launch : all) backend::muon_cpu(launch);
  }
}

}  // namespace

void MuonShardedPlan::momentum(const MuonStepInputs& in, Stream stream) const {
  validate_inputs(in);
  run_part(launches(in, kMomentum), rows_gemm_.get(), false, options_.graphs, device(), stream);
}

void MuonShardedPlan::orthogonalize(const MuonStepInputs& in, Stream stream) const {
  validate_inputs(in);
  run_part(launches(in, kOrthogonalize), owned_gemm_.get(), !offsets_.empty(), options_.graphs, device(), stream);
}

void MuonShardedPlan::update(const MuonStepInputs& in, Stream stream) const {
  validate_inputs(in);
  run_part(launches(in, kUpdate), update_gemm_.get(), false, options_.graphs, device(), stream);
}

void MuonShardedPlan::set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters) {
  hyper_.set(kOp, hyperparameters, device());
}

void MuonShardedPlan::set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters, Stream stream) {
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
