// The Adam / AdamW update over tensor lists, in one pass over memory.
// docs/ops.md ("adam_step") states exactly what it computes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

// Where weight decay enters (docs/ops.md spells out each).
enum class WeightDecay : int32_t {
  l2 = 0,            // classic Adam: g += weight_decay * w before the moments
  decoupled = 1,     // AdamW as in PyTorch: w *= 1 - lr * weight_decay before the update
  hugging_face = 2,  // AdamW as in Hugging Face Transformers: w -= lr * weight_decay * w after it
};

// One parameter group's hyperparameters.
struct AdamHyperparameters {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  WeightDecay decay = WeightDecay::decoupled;
  bool bias_correction = true;
  bool amsgrad = false;
  bool maximize = false;
};

// Throws Error naming `op` and `arg` (e.g. "groups[1].beta1") unless every
// field is in range: lr >= 0, 0 <= beta < 1, eps > 0, weight_decay >= 0, all
// finite.
void validate(const AdamHyperparameters& h, std::string_view op, const std::string& arg);

}  // namespace gradkit

#include "gradkit/ops/detail/group_table.h"

namespace gradkit {

// The lists an update reads and writes; tensor i of each list belongs to the
// same parameter. Supported dtypes: weights f32 with gradients f32/f16/bf16,
// moments f32, bf16 or u8 (both the same), optional model copy f16 or bf16;
// weights bf16 with their remainder (i16), gradients f32/f16/bf16, moments
// f32, bf16 or u8, no model copy; or everything f64 (no copy).
//
// u8 moments are 8-bit blockwise (gradkit/ops/low_bit.h): exp_avg with
// the signed code, exp_avg_sq with the unsigned one, each with its f32
// absmax list (quant_blocks(numel) elements per tensor); no amsgrad. With
// moment_bits = 4 they are 4-bit blockwise instead (docs/ops.md).
struct AdamTensors {
  std::span<const TensorView> weights;
  std::span<const TensorView> grads;
  std::span<const TensorView> exp_avg;         // first moment m
  std::span<const TensorView> exp_avg_sq;      // second moment v
  std::span<const TensorView> max_exp_avg_sq;  // amsgrad's running max of v; required if any group uses amsgrad
  std::span<const TensorView> model_copy;      // optional low-precision copy of the weights, written in the same pass
  std::span<const TensorView> exp_avg_absmax;     // u8 moments: each block's absmax of m
  std::span<const TensorView> exp_avg_sq_absmax;  // u8 moments: each block's absmax of v
  // bf16 weights: what rounding the f32 master to the weight took away
  // (docs/ops.md, "the remainder master"); the master is (weight, remainder).
  std::span<const TensorView> weight_remainder;
  // u8 moments: 8 (one code a byte, blocks of kQuantBlock) or 4 (two codes a
  // byte, quant4_bytes(numel) bytes per tensor; blocks of kQuant4Block, so
  // quant4_blocks(numel) absmax values: gradkit/ops/low_bit.h).
  int32_t moment_bits = 8;
};

// Per-step inputs. Each may be a host value or a pointer into memory on the
// plan's device, so that the whole step can be captured in a CUDA graph.
struct AdamStepInputs {
  int64_t step = 1;                   // t, from 1 (used when step_device is null)
  const int64_t* step_device = nullptr;
  const float* lr_device = nullptr;   // one lr per group, replacing the plan's lrs; null: the plan's
  float grad_scale = 1.0f;            // gradients are divided by this (loss scale x clip factor)
  const float* grad_scale_device = nullptr;
  const bool* found_inf = nullptr;    // if *found_inf, the whole step writes nothing
};

class AdamPlan {
 public:
  // `groups` gives each tensor's group index into `hyperparameters` (empty:
  // every tensor in group 0). Validates everything; uploads the tables.
  AdamPlan() = default;
  AdamPlan(const AdamTensors& tensors, std::span<const AdamHyperparameters> hyperparameters,
           std::span<const int32_t> groups = {});

  // Applies one update. Validates `inputs` before anything is written.
  void step(const AdamStepInputs& inputs, Stream stream = {}) const;
  // The checks step() makes, for callers that enqueue work of their own first.
  void validate_inputs(const AdamStepInputs& inputs) const;

  // Replaces the hyperparameters (same group count); the CUDA table is
  // rewritten synchronously.
  void set_hyperparameters(std::span<const AdamHyperparameters> hyperparameters);

  // Points the plan at new gradients (the same count, element counts, dtype
  // and device) with one small copy enqueued on `stream` instead of a new
  // plan: for frameworks that allocate new gradient tensors each step. See
  // MultiTensorPlan::repoint.
  void set_grads(std::span<const TensorView> grads, Stream stream = {}) { plan_.repoint(1, grads, stream); }

  const MultiTensorPlan& plan() const { return plan_; }
  std::span<const AdamHyperparameters> hyperparameters() const { return hyper_.host(); }
  bool has_model_copy() const { return lists_.model_copy >= 0; }
  bool has_max_exp_avg_sq() const { return lists_.max_exp_avg_sq >= 0; }
  bool quantized_moments() const { return lists_.absmax >= 0; }
  int32_t moment_bits() const { return moment_bits_; }
  bool has_weight_remainder() const { return lists_.remainder >= 0; }

  // Where each optional list sits in plan() (-1: absent).
  struct Lists {
    int max_exp_avg_sq = -1, model_copy = -1, absmax = -1, remainder = -1;  // absmax: m's, then v's at absmax + 1
  };

 private:
  MultiTensorPlan plan_;
  detail::GroupTable<AdamHyperparameters> hyper_;
  Lists lists_;
  int32_t moment_bits_ = 0;  // 8 or 4 with u8 moments, else 0
  std::shared_ptr<void> tables_;  // the code tables, on the plan's CUDA device (8- or 4-bit moments)
};

// One call, planned each time (see docs/ops.md on unplanned calls).
void adam_step(const AdamTensors& tensors, const AdamHyperparameters& hyperparameters,
               const AdamStepInputs& inputs, Stream stream = {});

}  // namespace gradkit
