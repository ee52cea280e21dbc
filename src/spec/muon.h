// The Muon kernels each backend implements, over a validated MuonPlan: per
// batch (matrices of one shape and one group), the momentum pass, the
// Frobenius normalisation, ns_steps Newton-Schulz iterations and the weight
// update, in that order on one stream (docs/ops.md, "muon_step").
#pragma once

#include <span>

#include "gradkit/ops/muon.h"
#include "spec/exact_math.h"

namespace gradkit::spec {

// Which part of the step a launch runs: the whole step on whole matrices
// (MuonPlan), or one of MuonShardedPlan's three parts.
enum class MuonStage : uint8_t {
  whole,          // momentum, normalisation, Newton-Schulz, weight update
  momentum,       // rows: the momentum pass, the update's rows to the plan's list 3 (bf16)
  orthogonalize,  // whole matrices: assembled from the exchange buffer's pieces, orthogonalised, written back there
  update,         // rows: the weight update from the plan's list 3 (bf16)
};

// One rank's piece of an owned matrix in the owner's exchange buffer: rows
// [row, row + rows) and columns [col, col + width) of the matrix, row-major
// from element `at` of the buffer. A matrix has one per rank, in rank order;
// each of its elements lies in exactly one (an empty piece has rows or
// width 0).
struct MuonPiece {
  int64_t row, rows;
  int64_t col, width;
  int64_t at;
};

// Where element (i, j) of an owned matrix lies in the exchange buffer, from
// the piece that holds it.
GRADKIT_HD int64_t piece_element(const MuonPiece& p, int64_t i, int64_t j) {
  return p.at + (i - p.row) * p.width + (j - p.col);
}

// The piece holding element (i, j): `s` where it does (a thread's elements
// mostly stay in one piece), else the search of the matrix's pieces.
GRADKIT_HD bool piece_holds(const MuonPiece& p, int64_t i, int64_t j) {
  return i >= p.row && i < p.row + p.rows && j >= p.col && j < p.col + p.width;
}
GRADKIT_HD int32_t piece_holding(const MuonPiece* pieces, int32_t ranks, int32_t s, int64_t i, int64_t j) {
  if (piece_holds(pieces[s], i, j)) return s;
  for (int32_t r = 0; r < ranks; ++r) {
    if (piece_holds(pieces[r], i, j)) return r;
  }
  return s;  // not reached: the plan's pieces tile each matrix
}

// The same where the pieces are whole rows in rank order (FSDP2's Shard(0)):
// the last piece beginning at or before element e (matrix of `cols`
// columns); a thread's elements go up, so its piece only moves on.
GRADKIT_HD int32_t row_piece_holding(const MuonPiece* pieces, int32_t ranks, int32_t s, int64_t e, int64_t cols) {
  while (s + 1 < ranks && e >= pieces[s + 1].row * cols) ++s;
  return s;
}

struct MuonLaunch {
  const MuonPlan::Batch* batch;
  const MuonHyperparameters* hyper;  // the batch's group (host memory: the products' coefficients)
  const MuonHyperparameters* table;  // the same in the plan's table on its device (the element passes read it)
  void* workspace;                   // the plan's (muon_workspace_bytes of the largest batch)
  const void* gemm = nullptr;        // the CUDA backend's per-plan state (muon_cuda_gemm)
  const bool* found_inf = nullptr;
  float grad_scale = 1.0f;
  const float* grad_scale_device = nullptr;
  int64_t split_from = 0;  // MuonPlanOptions::split_from
  int lane = -1;           // CUDA: the side stream the batch runs on (muon_cuda_fork), or -1: the caller's
  MuonStage stage = MuonStage::whole;
  // orthogonalize: the batch's pieces (count x ranks, on the plan's device)
  // and the owner's exchange buffer (bf16) they point into.
  const MuonPiece* pieces = nullptr;
  void* exchange = nullptr;
  int32_t ranks = 0;
  bool pieces_by_rows = false;  // every piece whole rows, in rank order (row_piece_holding)
};

// The workspace one batch needs on each backend (the plan keeps the largest).
size_t muon_cpu_workspace_bytes(const MuonPlan::Batch& batch);
size_t muon_cuda_workspace_bytes(const MuonPlan::Batch& batch);
// The same for `count` matrices of rows x cols in `chunks` chunks; the
// workspace begins with the matrices, one after another, in the backend's
// dtype (muon_workspace_dtype): an orthogonalize batch's plan lists them.
size_t muon_cpu_workspace_bytes(int64_t count, int64_t rows, int64_t cols, size_t chunks);
size_t muon_cuda_workspace_bytes(int64_t count, int64_t rows, int64_t cols, size_t chunks);
inline DType muon_workspace_dtype(Device device) { return device.is_cuda() ? DType::bf16 : DType::f32; }

void muon_cpu(const MuonLaunch& launch);
// Every batch of a step on CUDA: at once on the side streams (`concurrent`,
// forked from and joined into `stream`) or one after another; recorded into
// a CUDA graph and replayed when `graphs` and `stream` is not recording.
// `slot` names the recording: a plan that runs different sets of launches
// (MuonShardedPlan's buckets) keeps one recording for each.
void muon_cuda_step(const void* gemm, std::span<const MuonLaunch> launches, bool concurrent, bool graphs,
                    Stream stream, size_t slot = 0);
// Chooses every product's cuBLASLt algorithm for these launches, launching
// nothing: a plan does it when it is made, so that a step cannot fail
// half-way on a product cuBLASLt has no algorithm for.
void muon_cuda_prepare(const void* gemm, std::span<const MuonLaunch> launches);

// muon_cuda_step, recording `slot`, on the plan's side stream `side`
// (muon_cuda_gemm's `sides`), started after what `stream` holds so far;
// `stream` goes on without it until muon_cuda_join(gemm, stream, slot)
// makes it wait for that slot's launches. Two slots on two sides run at
// once: the caller gives them launches that share no workspace and no lane.
void muon_cuda_beside(const void* gemm, std::span<const MuonLaunch> launches, bool concurrent, bool graphs,
                      Stream stream, size_t slot, size_t side);
void muon_cuda_join(const void* gemm, Stream stream, size_t slot);

// The CUDA backend's per-plan state (a cuBLASLt handle and workspace,
// `lanes` side streams with a workspace each, and `sides` streams and
// `slots` slots for muon_cuda_beside; without `products`, only what
// recording a step needs), made once per plan.
std::shared_ptr<void> muon_cuda_gemm(Device device, int lanes, bool products = true, int sides = 0, int slots = 0);


}  // namespace gradkit::spec
