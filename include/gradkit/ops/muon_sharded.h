// Muon over matrices split over ranks (FSDP2's Shard(0) parameters, tensor-
// and expert-parallel DTensors, 2-D meshes): Newton-Schulz needs each whole
// matrix, so every matrix gets an owner rank, the ranks' pieces of its
// update travel to the owner, the owner orthogonalises its matrices, and the
// pieces travel back. The step is three parts with all-to-alls between
// them; the caller runs the all-to-alls with its own engine
// (torch.distributed, NCCL, MPI), on the plan's exchange buffers. The matrices go in buckets
// (MuonPlanOptions::buckets), each with its own parts and exchange
// sections, so that one bucket can travel while another is orthogonalised.
// docs/ops.md ("muon_step over shards") states what it computes: the
// unsharded MuonPlan's step, bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gradkit/ops/muon.h"

namespace gradkit {

// One rank's block of a tensor of MatrixShape (batch, rows, cols): matrices
// [batch_first, batch_first + batches), and of each, rows [row_first,
// row_first + rows) and columns [col_first, col_first + cols). The rank's
// shard holds the block in that order (matrix, row, column), contiguous: a
// DTensor's local tensor under Shard placements on any mesh (Shard(0) a
// block of rows, Shard(1) of columns, a 2-D mesh both, experts a block of
// whole matrices). A count of 0 is an empty block.
struct MatrixBlock {
  int64_t batch_first = 0, batches = 0;
  int64_t row_first = 0, rows = 0;
  int64_t col_first = 0, cols = 0;
  int64_t numel() const { return batches * rows * cols; }
};

struct MuonShardedTensors {
  // This rank's piece of each tensor (each may be empty), as MuonTensors.
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
  // Or, with row_splits empty: ranks blocks per tensor, one tensor after
  // another, rank r's block r. The ranks' blocks tile the tensor: every
  // element in exactly one.
  std::span<const MatrixBlock> blocks;
};

class MuonShardedPlan {
 public:
  MuonShardedPlan() = default;
  // Validates everything (as MuonPlan, plus the splits or blocks against
  // each shard's size and the tensor); gives each matrix an owner (the rank
  // with the fewest Newton-Schulz FLOPs so far, largest matrices first, or
  // the rank holding the whole matrix where that costs the balance at most
  // the matrix: the same on every rank); plans this rank's pieces and its
  // owned matrices; allocates the two exchange buffers and the owned
  // batches' workspace.
  MuonShardedPlan(const MuonShardedTensors& tensors, std::span<const MuonHyperparameters> hyperparameters,
                  std::span<const int32_t> groups = {}, MuonPlanOptions options = {});

  // The step's parts, bucket by bucket (MuonPlanOptions::buckets); each
  // bucket's matrices are a fixed set, and its exchanges carry only them.
  // The bucket forms take their inputs and stream explicitly, so that
  // momentum({}) stays the every-bucket form below:
  // 1. The momentum pass over this rank's pieces of the bucket's matrices;
  //    each piece of the update (bf16, the Newton-Schulz input) goes to
  //    shard_buffer(bucket), in the section of the matrix's owner.
  void momentum(size_t bucket, const MuonStepInputs& inputs, Stream stream) const;
  //    All-to-all: shard_buffer(bucket)'s section r (shard_counts(bucket)[r]
  //    elements) to rank r, owner_buffer(bucket)'s section r
  //    (owner_counts(bucket)[r]) from rank r.
  // 2. The owner's matrices of the bucket, assembled from owner_buffer(bucket),
  //    normalised and orthogonalised; the result's pieces go back where
  //    each rank's came from.
  void orthogonalize(size_t bucket, const MuonStepInputs& inputs, Stream stream) const;
  // 2'. The same without holding `stream` up: the products start after what
  //    `stream` holds so far, on a side stream of the plan's, and
  //    join(bucket, stream) makes `stream` wait for them. Buckets run at
  //    once when each of this rank's owned batches has a workspace and a
  //    side stream of its own (small matrices: MuonPlanOptions::streams),
  //    else one after another, each still beside `stream`. On the CPU it
  //    orthogonalises at once and join does nothing.
  void orthogonalize_beside(size_t bucket, const MuonStepInputs& inputs = {}, Stream stream = {}) const;
  void join(size_t bucket, Stream stream = {}) const;
  //    All-to-all back: owner_buffer(bucket)'s sections to the ranks, into
  //    shard_buffer(bucket).
  // 3. The weight update of this rank's pieces of the bucket's matrices from
  //    shard_buffer(bucket).
  void update(size_t bucket, const MuonStepInputs& inputs, Stream stream) const;
  // Each part for every bucket at once (one launch sequence): what a caller
  // that exchanges every bucket between two parts runs.
  void momentum(const MuonStepInputs& inputs = {}, Stream stream = {}) const;
  void orthogonalize(const MuonStepInputs& inputs = {}, Stream stream = {}) const;
  void update(const MuonStepInputs& inputs = {}, Stream stream = {}) const;

  void validate_inputs(const MuonStepInputs& inputs) const;
  void set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters);
  void set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters, Stream stream);
  // As MuonPlan::set_grads, for this rank's pieces.
  void set_grads(std::span<const TensorView> grads, Stream stream = {});

  // The buckets, and each one's exchange buffers (bf16, on the plan's
  // device; the buckets' buffers lie one after another) and their sections'
  // element counts, one per rank in rank order.
  size_t num_buckets() const { return bucket_flops_.size(); }
  TensorView shard_buffer(size_t bucket) const;
  TensorView owner_buffer(size_t bucket) const;
  std::span<const int64_t> shard_counts(size_t bucket) const;
  std::span<const int64_t> owner_counts(size_t bucket) const;
  // Newton-Schulz FLOPs (per iteration) of the bucket's matrices, all owners'.
  double bucket_flops(size_t bucket) const;
  // Whether orthogonalize_beside runs different buckets at once.
  bool buckets_at_once() const { return at_once_; }

  Device device() const { return all_.device(); }
  int32_t rank() const { return rank_; }
  int32_t ranks() const { return ranks_; }
  size_t num_tensors() const { return all_.num_tensors(); }
  std::span<const MuonHyperparameters> hyperparameters() const { return hyper_.host(); }
  // The owner of matrix `matrix` of tensor `tensor`, and its bucket.
  int32_t owner(size_t tensor, int64_t matrix) const;
  size_t bucket(size_t tensor, int64_t matrix) const;
  // Newton-Schulz FLOPs (per iteration) of the matrices this rank owns.
  double owned_flops() const { return owned_flops_; }
  size_t num_owned_batches() const { return owned_.size(); }
  size_t workspace_bytes() const { return workspace_.bytes(); }

 private:
  // A part's launches for one bucket, or every bucket's (kAllBuckets).
  static constexpr size_t kAllBuckets = ~size_t{0};
  std::vector<spec::MuonLaunch> launches(const MuonStepInputs& inputs, int stage, size_t bucket) const;
  void run(int stage, size_t bucket, const MuonStepInputs& inputs, Stream stream) const;
  size_t checked(size_t bucket) const;  // the bucket, refused if there is none such
  size_t matrix_index(size_t tensor, int64_t matrix) const;  // in the global list, refused if out of range

  MultiTensorPlan all_;  // this rank's pieces of the whole tensors, validated once
  detail::GroupTable<MuonHyperparameters> hyper_;
  int32_t rank_ = 0, ranks_ = 1;
  std::vector<int64_t> first_matrix_;  // each tensor's first matrix in the global list
  std::vector<int32_t> owners_;        // each matrix's owner, in the global list
  std::vector<size_t> buckets_;        // each matrix's bucket, in the global list
  std::vector<MuonPlan::Batch> rows_;  // this rank's pieces, a batch per global batch (lists: params, grads,
                                       // momentum, their place in shard_buffer)
  std::vector<size_t> rows_bucket_, owned_bucket_;  // each rows_ and owned_ batch's bucket
  // Each rows batch's matrices: which tensor, and the piece's first element
  // and element count in this rank's shard of it.
  struct RowSlice {
    int32_t tensor;
    int64_t first, elements;
  };
  static std::vector<TensorView> slice_views(std::span<const RowSlice> slices, std::span<const TensorView> tensors);
  std::vector<std::vector<RowSlice>> row_slices_;
  std::vector<MuonPlan::Batch> owned_; // the whole matrices this rank owns (list: the workspace's matrices)
  std::vector<size_t> owned_pieces_;   // each owned batch's first entry in pieces_
  std::vector<uint8_t> owned_by_rows_; // whether each owned batch's pieces are whole rows in rank order
  std::vector<size_t> offsets_;        // concurrent owned batches: each one's workspace offset
  int lanes_ = 0;
  bool at_once_ = false;  // orthogonalize_beside: each bucket on its own side stream
  double owned_flops_ = 0;
  MuonPlanOptions options_;
  Buffer shard_buffer_, owner_buffer_, pieces_, workspace_;
  // Per bucket, then per rank (bucket-major: the buffers' order).
  std::vector<int64_t> shard_counts_, owner_counts_, shard_at_, owner_at_;
  std::vector<double> bucket_flops_;
  std::shared_ptr<void> rows_gemm_, update_gemm_, owned_gemm_;  // CUDA: a recorded step per part
};

}  // namespace gradkit
