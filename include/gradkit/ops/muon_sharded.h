// Muon over matrices whose rows are split over ranks (FSDP2's Shard(0)
// parameters): Newton-Schulz needs each whole matrix, so every matrix gets
// an owner rank, the ranks' rows of its update travel to the owner, the
// owner orthogonalises its matrices, and the rows travel back. The step is
// three parts with an all-to-all between each two; the caller runs the
// all-to-alls with its own engine (torch.distributed, NCCL, MPI), on the
// plan's two exchange buffers. docs/ops.md ("muon_step over row shards")
// states what it computes: the unsharded MuonPlan's step, bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gradkit/ops/muon.h"

namespace gradkit {

struct MuonShardedTensors {
  // This rank's rows of each tensor (each may be empty), as MuonTensors.
  std::span<const TensorView> params;
  std::span<const TensorView> grads;
  std::span<const TensorView> momentum;
  // Each whole tensor's shape: batch * rows rows of cols elements (a 3-D
  // stack's matrices one after another).
  std::span<const MatrixShape> shapes;
  // ranks + 1 entries per tensor, one tensor after another: rank r holds
  // rows [row_splits[r], row_splits[r + 1]) of the tensor's batch * rows,
  // from 0 to batch * rows, non-decreasing (torch.chunk's split for FSDP2).
  std::span<const int64_t> row_splits;
  int32_t rank = 0;
  int32_t ranks = 1;
};

class MuonShardedPlan {
 public:
  MuonShardedPlan() = default;
  // Validates everything (as MuonPlan, plus the splits against each shard's
  // size); gives each matrix an owner (the rank with the fewest
  // Newton-Schulz FLOPs so far, largest matrices first: the same on every
  // rank); plans this rank's rows and its owned matrices; allocates the two
  // exchange buffers and the owned batches' workspace.
  MuonShardedPlan(const MuonShardedTensors& tensors, std::span<const MuonHyperparameters> hyperparameters,
                  std::span<const int32_t> groups = {}, MuonPlanOptions options = {});

  // 1. The momentum pass over this rank's rows; each row of the update
  //    (bf16, the Newton-Schulz input) goes to shard_buffer(), in the
  //    section of the matrix's owner.
  void momentum(const MuonStepInputs& inputs = {}, Stream stream = {}) const;
  //    All-to-all: shard_buffer()'s section r (shard_counts()[r] elements)
  //    to rank r, owner_buffer()'s section r (owner_counts()[r]) from rank r.
  // 2. The owner's matrices, assembled from owner_buffer(), normalised and
  //    orthogonalised; the result's rows go back where each rank's came from.
  void orthogonalize(const MuonStepInputs& inputs = {}, Stream stream = {}) const;
  //    All-to-all back: owner_buffer()'s sections to the ranks, into
  //    shard_buffer().
  // 3. The weight update of this rank's rows from shard_buffer().
  void update(const MuonStepInputs& inputs = {}, Stream stream = {}) const;

  void validate_inputs(const MuonStepInputs& inputs) const;
  void set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters);
  void set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters, Stream stream);
  // As MuonPlan::set_grads, for this rank's rows.
  void set_grads(std::span<const TensorView> grads, Stream stream = {});

  // The exchange buffers (bf16, on the plan's device) and their sections'
  // element counts, one per rank in rank order.
  TensorView shard_buffer() const;
  TensorView owner_buffer() const;
  std::span<const int64_t> shard_counts() const { return shard_counts_; }
  std::span<const int64_t> owner_counts() const { return owner_counts_; }

  Device device() const { return all_.device(); }
  int32_t rank() const { return rank_; }
  int32_t ranks() const { return ranks_; }
  size_t num_tensors() const { return all_.num_tensors(); }
  std::span<const MuonHyperparameters> hyperparameters() const { return hyper_.host(); }
  // The owner of matrix `matrix` of tensor `tensor`.
  int32_t owner(size_t tensor, int64_t matrix) const;
  // Newton-Schulz FLOPs (per iteration) of the matrices this rank owns.
  double owned_flops() const { return owned_flops_; }
  size_t num_owned_batches() const { return owned_.size(); }
  size_t workspace_bytes() const { return workspace_.bytes(); }

 private:
  std::vector<backend::MuonLaunch> launches(const MuonStepInputs& inputs, int stage) const;

  MultiTensorPlan all_;  // this rank's rows of the whole tensors, validated once
  detail::GroupTable<MuonHyperparameters> hyper_;
  int32_t rank_ = 0, ranks_ = 1;
  std::vector<int64_t> first_matrix_;  // each tensor's first matrix in the global list
  std::vector<int32_t> owners_;        // each matrix's owner, in the global list
  std::vector<MuonPlan::Batch> rows_;  // this rank's rows, a batch per global batch (lists: params, grads,
                                       // momentum, their place in shard_buffer)
  // Each rows batch's matrices: which tensor, and the rows' first element
  // and element count in this rank's shard of it.
  struct RowSlice {
    int32_t tensor;
    int64_t first, elements;
  };
  static std::vector<TensorView> slice_views(std::span<const RowSlice> slices, std::span<const TensorView> tensors);
  std::vector<std::vector<RowSlice>> row_slices_;
  std::vector<MuonPlan::Batch> owned_; // the whole matrices this rank owns (list: the workspace's matrices)
  std::vector<size_t> owned_pieces_;   // each owned batch's first entry in pieces_
  std::vector<size_t> offsets_;        // concurrent owned batches: each one's workspace offset
  int lanes_ = 0;
  double owned_flops_ = 0;
  MuonPlanOptions options_;
  Buffer shard_buffer_, owner_buffer_, pieces_, workspace_;
  std::vector<int64_t> shard_counts_, owner_counts_;
  std::shared_ptr<void> rows_gemm_, update_gemm_, owned_gemm_;  // CUDA: a recorded step per part
};

}  // namespace gradkit
