// Mixed-precision training around Adam or LAMB (ONNX Runtime's
// FP16_Optimizer): f32 master weights made from the model's f16/bf16
// weights, a loss scaler on the device, and a step in two passes over the
// gradients: one read pass that checks for Inf/NaN and computes the norm
// (unscaling and clipping are folded into the optimizer's gradient divisor),
// then the optimizer's update, which also writes the model's weights from
// the masters. A step with an overflow writes nothing but the scaler's
// decision. Every per-step value lives on the device: the whole step can be
// captured in one CUDA graph.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gradkit/ops/grad_check.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/loss_scaler.h"
#include "gradkit/optim/master_storage.h"

namespace gradkit {

struct MixedPrecisionOptions {
  LossScalerOptions scaler;
  float max_norm = 0.0f;  // > 0: clip the global norm of the unscaled gradients (clip_grad_norm_)
  NormType norm = NormType::l2;
  // remainder: bf16 weights only (with LAMB, float moments only); the master
  // is the same bit for bit, the weights the forward pass sees differ from
  // the f32 path's only on ties (rounded away from 0).
  MasterStorage master = MasterStorage::f32;
};

// Optimizer: Adam or Lamb. Each group's `params` are the model's f16 or bf16
// weights, `grads` its gradients (f16, bf16 or f32), `model_copy` empty (the
// model's weights are the copy the update writes; with remainder masters the
// update writes them directly).
template <class Optimizer>
class MixedPrecision {
 public:
  using Group = typename Optimizer::Group;
  using Options = typename Optimizer::Options;

  MixedPrecision(std::vector<Group> groups, MixedPrecisionOptions options = {}, Options optimizer_options = {});
  ~MixedPrecision();

  // Check, update (or skip), and the scaler's decision, enqueued on `stream`.
  void step(Stream stream = {});

  const float* loss_scale_device() const { return scaler_.scale_device(); }
  float loss_scale() const { return scaler_.state().scale; }  // synchronous read
  const bool* found_inf_device() const;
  bool last_step_skipped() const;  // synchronous read
  float last_grad_norm() const;    // unscaled global norm of the last step (synchronous)

  Optimizer& optimizer() { return *optimizer_; }
  LossScaler& scaler() { return scaler_; }
  const LossScaler& scaler() const { return scaler_; }
  // The f32 masters (empty with remainder masters), or the remainders (empty with f32 masters).
  const std::vector<TensorView>& masters() const { return masters_.masters(); }
  const std::vector<TensorView>& weight_remainders() const { return masters_.remainders(); }
  MasterStorage master_storage() const { return masters_.how(); }
  size_t master_bytes() const { return masters_.bytes(); }  // what keeping the masters costs

  // Masters, optimizer state and scaler in one state file; load checks all
  // of it before writing, then also rewrites the model's weights from the
  // loaded masters. The file holds f32 masters either way (remainder masters
  // joined on save and split on load, through a temporary f32 copy), so a
  // file loads whichever way the masters are kept.
  void save(const std::string& path) const;
  void load(const std::string& path);
  // As for Adam: the state as sections of a larger file. apply_state also
  // rewrites the model's weights from the loaded masters.
  void save_to(StateFile& file) const;
  void check_state(const std::string& path, const StateFile& file) const;
  void apply_state(const StateFile& file);

 private:
  MasterStore masters_;  // over the model's weights
  Buffer scalars_;  // found_inf, grad_divisor, global_norm
  GradientCheckPlan check_;
  LossScaler scaler_;
  std::unique_ptr<Optimizer> optimizer_;
};

using MixedPrecisionAdam = MixedPrecision<Adam>;
using MixedPrecisionLamb = MixedPrecision<Lamb>;

}  // namespace gradkit
