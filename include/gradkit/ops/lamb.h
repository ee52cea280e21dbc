// LAMB (ONNX Runtime's LambOptimizer semantics) over tensor lists, in exactly
// two passes over memory with deterministic per-tensor norms.
// docs/ops.md ("lamb_step") states exactly what it computes.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

// One group's hyperparameters (ONNX Runtime's per-group attributes).
struct LambHyperparameters {
  float alpha = 0.9f;     // beta1
  float beta = 0.999f;    // beta2
  float lambda = 0.0f;    // weight decay
  float epsilon = 1e-6f;
  float ratio_min = -std::numeric_limits<float>::infinity();  // the trust ratio is clamped to [ratio_min, ratio_max]
  float ratio_max = std::numeric_limits<float>::infinity();
  float max_norm = 1.0f;  // clipping threshold for gradient_norm (<= 0: no clipping)
  bool bias_correction = true;
};

// Throws Error naming `op` and `arg` unless 0 <= alpha, beta < 1,
// epsilon > 0, lambda >= 0, ratio_min <= ratio_max (neither NaN), max_norm
// finite.
void validate(const LambHyperparameters& h, std::string_view op, const std::string& arg);

// Throws Error naming `op` and `arg` unless eta, LAMB's learning rate, is
// finite and >= 0.
void validate_eta(float eta, std::string_view op, std::string_view arg);

}  // namespace gradkit

#include "gradkit/ops/detail/group_table.h"

namespace gradkit {

// Weights f32 with gradients f32/f16/bf16, moments f32, bf16 or u8 (both
// alike), optional model copy f16/bf16; weights bf16 with their remainder
// (i16), the same gradients, moments f32 or bf16 (not u8), no model copy and
// no update list; or everything f64. `update` (f32, or f64) receives
// w_new - w instead of writing the weights, when given.
//
// u8 moments are 8-bit blockwise exactly as adam_step's (gradkit/ops/
// low_bit.h): exp_avg with the signed code, exp_avg_sq with the unsigned
// one, each with its f32 absmax list (quant_blocks(numel) elements per
// tensor); with moment_bits = 4, 4-bit blockwise as adam_step's
// (quant4_bytes(numel) bytes, quant4_blocks(numel) absmax values). A block is
// then the unit of the non-finite rule: docs/ops.md.
struct LambTensors {
  std::span<const TensorView> weights;
  std::span<const TensorView> grads;
  std::span<const TensorView> exp_avg;
  std::span<const TensorView> exp_avg_sq;
  std::span<const TensorView> model_copy;  // optional
  std::span<const TensorView> update;      // optional: write the delta here, leave the weights
  std::span<const TensorView> exp_avg_absmax;     // u8 moments: each block's absmax of m
  std::span<const TensorView> exp_avg_sq_absmax;  // u8 moments: each block's absmax of v
  // bf16 weights: what rounding the f32 master to the weight took away
  // (docs/ops.md, "the remainder master"); the master is (weight, remainder).
  std::span<const TensorView> weight_remainder;
  int32_t moment_bits = 8;  // u8 moments: 8 or 4 (as AdamTensors::moment_bits)
};

// A step whose tensors are pieces of larger tensors held by several lists
// (the ranks' shards of one model): the trust ratio needs each whole
// tensor's norms, so the step runs in two calls with the norms' partial
// sums combined in between (docs/ops.md, "lamb_step in two passes").
enum class LambPass {
  both,    // the whole step (one call)
  first,   // pass 1 (moments), then each tensor's sums of w^2 and d^2 to `sums`
  second,  // the trust ratios from `sums` (every row's, added in row order), pass 2, the step counter
};
struct LambSplit {
  LambPass pass = LambPass::both;
  // On the plan's device. first: tensor i's two sums go to sums[2 index[i]]
  // and sums[2 index[i] + 1]; second: its sums are those of rows 0 .. rows-1,
  // row r at sums + r * row_stride.
  double* sums = nullptr;
  const int32_t* index = nullptr;  // one per tensor of the plan
  int rows = 1;
  int64_t row_stride = 0;
};

// Per-step inputs; each may be a host value or a pointer on the plan's device.
struct LambStepInputs {
  float eta = 1e-3f;  // learning rate, shared by every group
  const float* eta_device = nullptr;
  float loss_scale = 1.0f;
  const float* loss_scale_device = nullptr;
  float gradient_norm = -1.0f;  // < 0: not given (no clipping)
  const float* gradient_norm_device = nullptr;
  int64_t step = 1;  // t (>= 1) for bias correction
  int64_t* step_device = nullptr;  // read as t, then set to t + 1 if the update happens
  Flag do_update = Flag::none();   // false: nothing is written (and the step stays)
  const bool* found_inf = nullptr; // true: nothing is written (and the step stays)
  LambSplit split;                 // the whole step unless split.pass says otherwise
};

class LambPlan {
 public:
  LambPlan() = default;
  // `groups` gives each tensor's index into `hyperparameters` (empty: all in
  // group 0). Validates everything; allocates the scratch for the norms.
  LambPlan(const LambTensors& tensors, std::span<const LambHyperparameters> hyperparameters,
           std::span<const int32_t> groups = {});

  void step(const LambStepInputs& inputs, Stream stream = {}) const;
  void validate_inputs(const LambStepInputs& inputs) const;
  void set_hyperparameters(std::span<const LambHyperparameters> hyperparameters);

  // Points the plan at new gradients (the same count, element counts, dtype
  // and device) with one small copy enqueued on `stream` instead of a new
  // plan: for frameworks that allocate new gradient tensors each step. See
  // MultiTensorPlan::repoint.
  void set_grads(std::span<const TensorView> grads, Stream stream = {}) { plan_.repoint(1, grads, stream); }

  const MultiTensorPlan& plan() const { return plan_; }
  std::span<const LambHyperparameters> hyperparameters() const { return hyper_.host(); }
  bool quantized_moments() const { return absmax_list_ >= 0; }
  int32_t moment_bits() const { return moment_bits_; }
  bool has_weight_remainder() const { return remainder_list_ >= 0; }

 private:
  MultiTensorPlan plan_;
  detail::GroupTable<LambHyperparameters> hyper_;
  Buffer scratch_;  // per-chunk partial sums of squares, then per-tensor trust ratios
  int copy_list_ = -1;
  int update_list_ = -1;
  int absmax_list_ = -1;          // 8- or 4-bit moments: m's absmax list, v's at absmax_list_ + 1
  int32_t moment_bits_ = 0;       // 8 or 4 with u8 moments, else 0
  int remainder_list_ = -1;       // bf16 weights: their remainders
  std::shared_ptr<void> tables_;  // the code tables, on the plan's CUDA device (8- or 4-bit moments)
};

void lamb_step(const LambTensors& tensors, const LambHyperparameters& hyperparameters,
               const LambStepInputs& inputs, Stream stream = {});

}  // namespace gradkit
