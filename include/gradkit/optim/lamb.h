// An owning LAMB optimizer over parameter groups, like gradkit::Adam: it
// holds the moments, the step counter and the learning rate (eta) in device
// memory, so a whole step can be captured in a CUDA graph, and saves and
// loads its state bit-exactly.
#pragma once

#include <string>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/lamb.h"

namespace gradkit {

struct StateSection;  // src/optim/moment_storage.h
class StateFile;

struct LambGroup {
  std::vector<TensorView> params;      // f32 master weights (or f64), or bf16 weights with weight_remainder
  std::vector<TensorView> grads;       // f32, f16 or bf16 (f64 with f64 params)
  std::vector<TensorView> model_copy;  // optional f16/bf16 copy, written in the same pass
  // Optional: bf16 params' i16 remainders, which complete each to its f32
  // master (docs/ops.md, "the remainder master"); one per param, or none;
  // float moments only. Like the weights, they belong to the caller and are
  // not in Lamb's file.
  std::vector<TensorView> weight_remainder;
  LambHyperparameters hyperparameters;
};

struct LambOptions {
  float eta = 1e-3f;                // learning rate, shared by every group
  DType moment_dtype = DType::f32;  // f32; bf16; u8 for 8-bit blockwise moments (as Adam's; no weight_remainder)
  int32_t moment_bits = 8;          // with u8 moments: 8, or 4 for 4-bit blockwise moments (as Adam's)
};

// Per-step inputs of the owning optimizer (all optional).
struct LambStep {
  float loss_scale = 1.0f;
  const float* loss_scale_device = nullptr;
  float gradient_norm = -1.0f;  // < 0: no clipping
  const float* gradient_norm_device = nullptr;
  const bool* found_inf = nullptr;  // true when the step runs: nothing changes, the counter included
  LambSplit split;  // a step in two calls over pieces of larger tensors (LambStepInputs::split)
};

class Lamb {
 public:
  using Group = LambGroup;
  using Options = LambOptions;

  explicit Lamb(std::vector<LambGroup> groups, LambOptions options = {});

  void step(Stream stream = {}, const LambStep& inputs = {});

  int64_t step_count() const;  // completed updates (synchronous read)
  float eta() const;           // synchronous read
  void set_eta(float eta);     // synchronous write
  float* eta_device() const { return static_cast<float*>(eta_.data()); }
  // The t of the next update (step_count() + 1), on the device: for a caller
  // that runs LambPlans over the optimizer's tensors itself (Offloaded<Lamb>).
  int64_t* next_step_device() const { return static_cast<int64_t*>(counter_.data()); }

  const std::vector<TensorView>& exp_avg() const { return exp_avg_; }
  const std::vector<TensorView>& exp_avg_sq() const { return exp_avg_sq_; }
  // 8- or 4-bit moments: each tensor's per-block absmax of exp_avg and exp_avg_sq (empty otherwise).
  const std::vector<TensorView>& exp_avg_absmax() const { return exp_avg_absmax_; }
  const std::vector<TensorView>& exp_avg_sq_absmax() const { return exp_avg_sq_absmax_; }
  // 8 or 4 with u8 moments (options.moment_bits), else 0.
  int32_t moment_bits() const { return plan_.moment_bits(); }
  // Bytes of optimizer-owned state (moments, absmax, counter, eta).
  size_t state_bytes() const { return state_.bytes() + absmax_.bytes() + counter_.bytes() + eta_.bytes(); }

  void save(const std::string& path) const;
  void load(const std::string& path);
  // As for Adam: the state as sections of a larger file.
  void save_to(StateFile& file) const;
  void check_state(const std::string& path, const StateFile& file) const;
  void apply_state(const StateFile& file);

 private:
  std::vector<StateSection> sections() const;
  DType stored_moment_dtype() const;

  std::vector<LambGroup> groups_;
  LambOptions options_;
  Device device_;
  Buffer state_;
  Buffer absmax_;   // 8- or 4-bit moments: every absmax tensor
  Buffer counter_;  // int64: the t of the next update (ONNX Runtime's update_count), from 1
  Buffer eta_;      // float
  std::vector<TensorView> exp_avg_, exp_avg_sq_, exp_avg_absmax_, exp_avg_sq_absmax_;
  LambPlan plan_;
};

}  // namespace gradkit
