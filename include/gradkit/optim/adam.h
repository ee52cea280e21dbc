// An owning Adam/AdamW optimizer over parameter groups: it holds the moments
// (and amsgrad's running max), the step counter and each group's learning
// rate in device memory, so a whole step can be captured in a CUDA graph,
// and saves and loads its state bit-exactly.
#pragma once

#include <string>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"

namespace gradkit {

struct StateSection;  // src/optim/moment_storage.h
class StateFile;

struct AdamGroup {
  std::vector<TensorView> params;      // f32 master weights (or f64), or bf16 weights with weight_remainder
  std::vector<TensorView> grads;       // f32, f16 or bf16 (f64 with f64 params)
  std::vector<TensorView> model_copy;  // optional f16/bf16 copy of params, written in the same pass
  // Optional: bf16 params' i16 remainders, which complete each to its f32
  // master (docs/ops.md, "the remainder master"); one per param, or none.
  // Like the weights, they belong to the caller and are not in Adam's file.
  std::vector<TensorView> weight_remainder;
  AdamHyperparameters hyperparameters;
};

struct AdamOptions {
  // f32; bf16 to halve the optimizer state; u8 for 8-bit blockwise moments
  // (docs/ops.md, "8-bit moments": 2 bytes per parameter plus 8 per 256).
  DType moment_dtype = DType::f32;
  // With u8 moments: 8, or 4 for 4-bit blockwise moments (docs/ops.md, "4-bit
  // moments": 1 byte per parameter plus 8 per 128). Adam, MixedPrecision<Adam>,
  // Sharded<Adam> and Offloaded<Adam> take 4.
  int32_t moment_bits = 8;
};

class Adam {
 public:
  using Group = AdamGroup;
  using Options = AdamOptions;

  // Validates everything; allocates zeroed moments on the parameters' device.
  explicit Adam(std::vector<AdamGroup> groups, AdamOptions options = {});

  // One update. The step counter is incremented on the device first (so a
  // captured graph advances it on each replay) and the update uses the new
  // count. If `found_inf` is given and true when the step runs, neither the
  // counter nor any buffer changes. Gradients are divided by the gradient
  // scale (a host value, or a float on the device).
  void step(Stream stream = {}, const bool* found_inf = nullptr, const float* grad_scale_device = nullptr,
            float grad_scale = 1.0f);

  int64_t step_count() const;  // synchronous read of the device counter
  int64_t* step_count_device() const { return static_cast<int64_t*>(counter_.data()); }
  float lr(int group) const;  // synchronous read
  void set_lr(int group, float lr);  // synchronous write
  float* lr_device() const { return static_cast<float*>(lrs_.data()); }  // one float per group

  size_t num_groups() const { return groups_.size(); }
  const std::vector<TensorView>& exp_avg() const { return exp_avg_; }
  const std::vector<TensorView>& exp_avg_sq() const { return exp_avg_sq_; }
  const std::vector<TensorView>& max_exp_avg_sq() const { return max_exp_avg_sq_; }
  // 8- or 4-bit moments: each tensor's per-block absmax of exp_avg and exp_avg_sq (empty otherwise).
  // 4-bit moments' codes are flat: quant4_bytes(numel) bytes per tensor.
  const std::vector<TensorView>& exp_avg_absmax() const { return exp_avg_absmax_; }
  const std::vector<TensorView>& exp_avg_sq_absmax() const { return exp_avg_sq_absmax_; }
  // 8 or 4 with u8 moments (options.moment_bits), else 0.
  int32_t moment_bits() const { return plan_.moment_bits(); }
  // Bytes of optimizer-owned state (moments, absmax, counter, lrs).
  size_t state_bytes() const { return state_.bytes() + absmax_.bytes() + counter_.bytes() + lrs_.bytes(); }

  // The moments, step count and hyperparameters (not the weights: they
  // belong to the model). load() checks the whole file against this
  // optimizer's groups, shapes and dtypes before it writes anything.
  void save(const std::string& path) const;
  void load(const std::string& path);

  // The same state as sections of a larger file (a wrapper's): save_to adds
  // them; check_state throws io_error unless they fit this optimizer;
  // apply_state (after check_state) writes them.
  void save_to(StateFile& file) const;
  void check_state(const std::string& path, const StateFile& file) const;
  void apply_state(const StateFile& file);

 private:
  void upload_lrs();
  std::vector<StateSection> sections() const;

  std::vector<AdamGroup> groups_;
  AdamOptions options_;
  Device device_;
  Buffer state_;    // every moment tensor, back to back at 256-byte boundaries
  Buffer absmax_;   // 8-bit moments: every absmax tensor, likewise
  Buffer counter_;  // int64 step count
  Buffer lrs_;      // float per group
  std::vector<TensorView> exp_avg_, exp_avg_sq_, max_exp_avg_sq_, exp_avg_absmax_, exp_avg_sq_absmax_;
  AdamPlan plan_;
};

}  // namespace gradkit
