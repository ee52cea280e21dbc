// What MuonPlan and MuonShardedPlan share: the checks of their tensors and
// shapes, the batch bound, and a matrix's view inside a tensor.
#pragma once

#include <cstdint>
#include <string>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "spec/muon.h"
#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/ops/muon.h"

namespace gradkit::muon_detail {

// A batch is closed before it passes this many elements (256 MiB of bf16),
// so that the workspace stays a fraction of the model however many same-
// shape matrices it has; the products are as fast at this size as beyond.
constexpr int64_t kMaxBatchElements = int64_t{1} << 27;
// The most workspace the batches may take together to run at once
// (MuonPlanOptions::streams).
constexpr size_t kConcurrentWorkspace = size_t{64} << 20;

inline std::string indexed(std::string_view list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

// params f32 or bf16, grads f32, f16 or bf16, momentum f32 or bf16 (lists 0-2).
void check_dtypes(std::string_view op, const MultiTensorPlan& plan);
// The shape's sides are >= 1 and batch * rows * cols is `numel`.
void check_shape(std::string_view op, size_t i, const MatrixShape& s, int64_t numel);

// NorMuon's second moments: empty, or one f32 tensor per parameter of
// muon_second_moment_numel elements on the parameters' device; required
// when a group has second_moment.
void check_second_moment(std::string_view op, std::span<const TensorView> second_moment,
                         std::span<const TensorView> params, std::span<const MatrixShape> shapes,
                         std::span<const MuonHyperparameters> hyperparameters, std::span<const int32_t> groups);

// MuonShardedPlan's owners orthogonalise whole matrices and the ranks
// update their rows: the result's scales (renormalize, second_moment) need
// each whole result and a second moment per line beside the rows, which
// the sharded plan does not keep; refused naming the field.
void check_sharded_recipe(const MuonHyperparameters& h, std::string_view op, const std::string& arg);

// found_inf and grad_scale_device on `device` (or null), grad_scale finite
// and > 0 when no grad_scale_device is given.
void check_step_inputs(std::string_view op, const MuonStepInputs& inputs, Device device);

// `elements` elements of `t` from its element `first` on.
inline TensorView slice(const TensorView& t, int64_t first, int64_t elements) {
  TensorView v = t;
  v.data = static_cast<unsigned char*>(t.data) + static_cast<size_t>(first) * dtype_size(t.dtype);
  v.numel = elements;
  return v;
}

// Matrices to be orthogonalised together: one shape, one group, one owner
// rank; each source is a tensor and a matrix index within it.
struct MatrixBatch {
  int64_t rows, cols;
  int32_t group, owner;
  std::vector<std::pair<int32_t, int64_t>> sources;
};
// Every tensor's matrices, in tensor order, into batches of one shape, one
// group (groups empty: all 0) and one owner (owners: each matrix's, matrix
// by matrix; empty: all 0), each closed before it passes kMaxBatchElements.
std::vector<MatrixBatch> batch_matrices(std::span<const MatrixShape> shapes, std::span<const int32_t> groups,
                                        std::span<const int32_t> owners);

// Where batches run when they may run at once: each batch's workspace
// offset and the side streams (lanes 0: one after another, in one
// workspace of the largest batch's size, offsets empty).
struct Concurrency {
  std::vector<size_t> offsets;
  int lanes = 0;
  size_t workspace = 0;  // bytes in all
};
Concurrency plan_concurrency(Device device, std::span<const size_t> batch_bytes, int32_t streams);

}  // namespace gradkit::muon_detail
