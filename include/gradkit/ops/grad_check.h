// One read pass over a gradient list that together detects any Inf/NaN,
// computes per-tensor and global norms of the unscaled gradients, and turns
// them into the divisor the optimizer applies (loss scale and clipping
// folded into one number), so that unscaling and clipping cost no pass of
// their own. docs/ops.md ("check_gradients") states exactly what it computes.
#pragma once

#include <memory>
#include <span>

#include "gradkit/core/memory.h"
#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

enum class NormType { l2, infinity };

struct GradientCheckOptions {
  NormType norm = NormType::l2;
  float max_norm = 0.0f;          // > 0: clip the global norm to this (PyTorch's clip_grad_norm_)
  bool write_unscaled = false;    // also multiply the gradients by 1/S in place
};

// Where the results go: each a pointer on the plan's device (host memory for
// the CPU backend); any may be null except where noted.
struct GradientCheckOutputs {
  bool* found_inf = nullptr;        // true if any gradient element is Inf or NaN
  float* grad_divisor = nullptr;    // S / clip_coefficient: divide the raw gradients by this
  float* global_norm = nullptr;     // norm of the unscaled gradients (Inf/NaN if found_inf)
  float* tensor_norms = nullptr;    // one per tensor, unscaled
  // What combine() needs from this list, when several lists (the ranks'
  // shards of one model) are checked as one: two doubles, the norm's
  // partial (the sum of squares of the unscaled values, or their largest
  // magnitude) and 1 if any value was not finite, else 0.
  double* partial = nullptr;
};

class GradientCheckPlan {
 public:
  GradientCheckPlan() = default;
  // Gradients of f32, f16 or bf16 (one dtype per list). Validates; allocates
  // the scratch for the partial norms.
  explicit GradientCheckPlan(std::span<const TensorView> grads, GradientCheckOptions options = {});

  // `loss_scale` S (> 0), or `loss_scale_device` (a float on the device).
  void check(const GradientCheckOutputs& outputs, float loss_scale = 1.0f, const float* loss_scale_device = nullptr,
             Stream stream = {}) const;

  // The outputs of one check over several lists, from `count` partials
  // (two doubles each, as check() writes to GradientCheckOutputs::partial,
  // on this plan's device), combined in index order: found_inf, global_norm
  // and grad_divisor as check() computes them for one list, with this
  // plan's options. tensor_norms and partial must be null (per-tensor norms
  // stay with each list).
  void combine(const double* partials, int count, const GradientCheckOutputs& outputs, float loss_scale = 1.0f,
               const float* loss_scale_device = nullptr, Stream stream = {}) const;

  // Points the plan at new gradients (the same count, element counts, dtype
  // and device) with one small copy enqueued on `stream` instead of a new
  // plan: for frameworks that allocate new gradient tensors each step. See
  // MultiTensorPlan::repoint.
  void set_grads(std::span<const TensorView> grads, Stream stream = {}) { plan_.repoint(0, grads, stream); }

  const MultiTensorPlan& plan() const { return plan_; }
  const GradientCheckOptions& options() const { return options_; }

 private:
  MultiTensorPlan plan_;
  GradientCheckOptions options_;
  Buffer scratch_;  // per chunk: sum of squares (or max) in f64, and a non-finite flag
};

}  // namespace gradkit
