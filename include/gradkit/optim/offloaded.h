// Adam/AdamW or LAMB with its state in host memory and its update on the
// CPU, for models whose optimizer state does not fit next to them on the GPU
// (DeepSpeed's ZeRO-Offload, torchao's CPUOffloadOptimizer). The model's
// weights and gradients stay on one CUDA device; the f32 masters and the
// moments live on the host, and the update is gradkit's CPU AdamPlan or
// LambPlan.
//
// The caller drives it bucket by bucket during backward (docs/offload.md):
// bucket_ready(k, s) says bucket k's gradients are complete in stream order
// on s; its gradients are copied to pinned host staging on a side stream,
// the CPU step of that bucket runs on the host as soon as they have arrived,
// and the updated weights (rounded to the weight dtype by the CPU kernel's
// model copy) are copied back on another side stream. finish(s) hands any
// bucket not yet handed and makes s wait for every copy-back. Copies,
// CPU work and the rest of backward overlap.
//
// With a loss scaler or clipping, the skip decision and the clip divisor
// need the whole gradient before any update: the copies still overlap
// backward, but the updates wait for finish(), which runs the gradient
// check (GradientCheckPlan) on the GPU over all gradients, copies its
// (found_inf, divisor) to the host, then runs the buckets' CPU steps one
// after another, each copy-back overlapping the next bucket's step. The
// step counter advances only for a step that is not skipped.
//
// With options.release the caller frees each bucket's gradients once it
// has handed them, so the GPU never holds them all; later hands of a bucket
// (micro-batches) are summed on the host, and the check runs on the host
// over those sums (docs/offload.md, "Gradient release").
//
// LAMB's trust ratio needs each tensor's whole norms, so Offloaded<Lamb>
// never cuts a tensor into pieces (a tensor larger than piece_bytes is a
// piece of its own): each piece runs both of LAMB's passes as soon as it
// may, and the norms are summed in the order the GPU sums them.
//
// Needs CUDA: in a build without it (or with no device) the constructor
// throws backend_unavailable after checking its arguments.
#pragma once

#include <atomic>
#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gradkit/ops/grad_check.h"
#include "gradkit/ops/gradient.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/loss_scaler.h"

namespace gradkit {

class StateFile;

namespace detail {
class OffloadLanes;
class HostWorker;
}  // namespace detail

// Where the host worker's time went in the last step, in milliseconds: for
// tuning buckets, pieces and threads. `span`: from the first bucket handed
// to the last copy-back queued; `copy_wait`: the worker waiting for pieces'
// gradients to reach the host (and, with a check, for its decision);
// `update`: the CPU steps themselves. span - copy_wait - update is the
// worker's own overhead (queueing copies).
struct OffloadStepTimes {
  double span_ms = 0, copy_wait_ms = 0, update_ms = 0;
};

struct OffloadedOptions {
  AdamOptions adam;  // Offloaded<Adam>: the host moments' dtype (f32, bf16 or u8) and bits (8 or 4)
  LambOptions lamb;  // Offloaded<Lamb>: eta and the host moments' dtype (f32, bf16 or u8) and bits
  // Each tensor's bucket, over the groups' params in order (indices from 0,
  // every index up to the largest used). Empty: consecutive tensors taken
  // from the last to the first (the order backward produces gradients in),
  // a new bucket begun once one holds `bucket_bytes` of gradients.
  std::vector<int32_t> buckets;
  size_t bucket_bytes = size_t{32} << 20;
  // Within a bucket, the copies and the CPU step go in pieces of about this
  // many bytes of gradients (a tensor larger than that is cut at multiples
  // of 256 elements, the 8-bit moments' block; never with LAMB, whose
  // pieces hold whole tensors): piece k's step runs while
  // piece k+1 crosses to the host and piece k-1's weights cross back. A
  // bucket handed at backward's end, such as the one holding a tied
  // embedding, would otherwise copy, step and copy back one after another.
  size_t piece_bytes = size_t{32} << 20;
  // A loss scaler on the GPU (LossScaling::none: only the overflow check and
  // the skip); none: no check unless max_norm > 0.
  std::optional<LossScalerOptions> scaler;
  // > 0: clip the global norm of the unscaled gradients (clip_grad_norm_,
  // folded into the gradient divisor). With LAMB this is its clipping, as in
  // MixedPrecision<Lamb>: the groups' own max_norm is given no norm.
  float max_norm = 0.0f;
  NormType norm = NormType::l2;
  // Threads of the CPU step (OpenMP). 0: every core but two, which are left
  // to the framework's threads that launch backward's kernels meanwhile.
  int host_threads = 0;
  // Gradient release (docs/offload.md, "Gradient release"): the caller frees
  // a bucket's gradients on the device once it has handed them (after the
  // copy that reads them, in the order of copy_stream()), so the GPU holds a
  // few buckets of gradients instead of all. A bucket may then be handed
  // more than once in a step (micro-batches, a tied weight's later
  // contributions): each later hand's gradients are added to the host
  // staging, each addition in f32 rounded to the gradient dtype, as torch
  // accumulates them on the GPU. The check (a scaler or max_norm) runs on
  // the host over the staged sums, since the device no longer holds them.
  bool release = false;
};

// Optimizer: Adam or Lamb.
template <class Optimizer>
class Offloaded {
 public:
  using Group = typename Optimizer::Group;

  // Each group's `params` are the model's weights (f32, f16 or bf16, one
  // dtype for all) and `grads` its gradients (f32, f16 or bf16), all on one
  // CUDA device; `model_copy` and `weight_remainder` empty. Validates
  // everything before anything is allocated; copies the weights to the host
  // masters (synchronously).
  explicit Offloaded(std::vector<Group> groups, OffloadedOptions options = {});
  ~Offloaded();  // waits for the step in flight
  Offloaded(const Offloaded&) = delete;
  Offloaded& operator=(const Offloaded&) = delete;

  int num_buckets() const;
  std::span<const int32_t> bucket_of_tensor() const;

  // Bucket `bucket`'s gradients are ready in stream order on `stream`.
  // `grads`, if given, are the bucket's gradients now (the same count,
  // element counts, dtype and device as before, in the bucket's tensor
  // order): for frameworks that allocate new gradient tensors each step.
  // `complete`: no more of this step's gradient will come for the bucket, so
  // its update (or, with release and a check, its part of the check) may
  // start now; otherwise it waits for a later hand or finish().
  // A second hand of a bucket in one step: with release, its gradients are
  // added to the first's; without, they replace the first's (gradients
  // changed after they were handed, e.g. by clipping), which is allowed only
  // while the updates wait for finish() (with a check). Throws then, if the
  // bucket was handed complete, or if the host work of an earlier bucket
  // failed (its error).
  void bucket_ready(int bucket, Stream stream = {}, std::span<const TensorView> grads = {}, bool complete = true);
  // The tensors of `bucket`, as indices into the groups' params in order.
  std::span<const size_t> bucket_tensors(int bucket) const;
  // Hands the buckets not yet handed (with release, every bucket must have
  // been handed: its gradients may be gone), runs the check and the ordered
  // steps when there is one, and makes `stream` wait for every copy-back.
  // Waits on the host until the last copy-back is queued, not for the GPU.
  void finish(Stream stream = {});
  // The stream the gradient copies to the host run on: a caller that frees
  // handed gradients tells its allocator that this stream reads them.
  Stream copy_stream() const;
  // Waits on the host for the step in flight; rethrows an error of its
  // host work.
  void synchronize();

  // Reads and writes of the host state: each waits on the host for the
  // step's CPU work (not for the GPU's copies), so a caller can read them
  // between steps without stalling the device.
  int64_t step_count();
  // Steps completed, for a framework that loads state of its own layout
  // (0 to 2^63 - 2 for Adam, 2^63 - 3 for LAMB, whose counter holds the
  // next t: the next step must be able to count).
  void set_step_count(int64_t steps);
  // Adam: each group's learning rate; LAMB: eta, shared by every group.
  float lr(int group) requires std::same_as<Optimizer, Adam>;
  void set_lr(int group, float lr) requires std::same_as<Optimizer, Adam>;
  float eta() requires std::same_as<Optimizer, Lamb>;
  void set_eta(float eta) requires std::same_as<Optimizer, Lamb>;
  bool last_step_skipped();
  float last_grad_norm();  // unscaled; NaN when no check runs
  OffloadStepTimes last_step_times();  // waits for the step's CPU work

  bool checks_gradients() const { return checks_; }
  bool releases_gradients() const { return options_.release; }
  LossScaler* scaler() { return scaler_ ? &*scaler_ : nullptr; }
  const LossScaler* scaler() const { return scaler_ ? &*scaler_ : nullptr; }
  const float* loss_scale_device() const { return scaler_ ? scaler_->scale_device() : nullptr; }

  // The host state (valid between steps, once the step's CPU work is done:
  // after finish() returns).
  const std::vector<TensorView>& masters() const { return masters_; }
  const Optimizer& host_optimizer() const { return *optimizer_; }
  // Bytes held in host memory (masters, moments, staging) and on the GPU
  // (only the check's scratch and scalars: no optimizer state).
  size_t host_bytes() const;
  size_t device_bytes() const;

  // The state in the format of the non-offloaded optimizer: f32 weights
  // give an 'adam' or 'lamb' file (the optimizer's sections, plus 'scaler'
  // with a scaler), f16/bf16 weights a 'mixed_precision_adam' or
  // 'mixed_precision_lamb' file (MixedPrecision's;
  // without a scaler its 'scaler' section holds a scale of 1 and is ignored
  // on load). Either file loads into either optimizer. load() checks the
  // whole file first, then writes the model's weights from the masters
  // (f16/bf16) or, for f32 weights, takes the masters from the model's
  // weights (load the model first).
  void save(const std::string& path);
  void load(const std::string& path);
  // The same state as sections of a larger file (a training checkpoint's):
  // save_to adds them; check_state throws io_error unless they fit;
  // apply_state (after check_state) writes them, as load() does.
  void save_to(StateFile& file);
  void check_state(const std::string& path, const StateFile& file) const;
  void apply_state(const StateFile& file);
  // For f32 weights: copies the model's weights into the masters, for a
  // caller who changed them outside the optimizer.
  void refresh_masters();

 private:
  struct Bucket;
  struct Piece;
  void hand(int bucket, Stream stream);  // the bucket's gradients to the host, piece by piece
  void hand_again(int bucket, Stream stream);  // with release: add them to what the host holds
  void bucket_complete(int bucket);      // its pieces' updates (or host checks) may start
  void post_update(int piece);           // the worker: wait for the piece's gradients, step, copy back
  void post_host_check(int piece);       // the worker: the piece's part of the check, on the host
  void finish_host_check();              // with release: the check from the pieces' parts
  void prepare_release(const GradientCheckOptions& check_options);  // the landings and the pieces' checks
  void copy_weights_to_device();

  std::vector<Group> groups_;  // the host optimizer's groups (masters, staged gradients) once made
  std::vector<TensorView> params_, grads_;  // the model's, on the device
  Device device_;
  bool low_precision_ = false;  // f16/bf16 weights: the CPU step writes a model copy
  OffloadedOptions options_;

  // Host memory: masters (pinned for f32 weights, which are copied back
  // from them), gradient staging and model-copy staging (pinned).
  Buffer masters_storage_, grad_staging_, copy_staging_, scalars_host_, scalars_device_;
  std::vector<TensorView> masters_, staged_grads_, staged_copies_;
  std::unique_ptr<Optimizer> optimizer_;  // over the host tensors: moments, counter, lrs, state format
  std::vector<Bucket> buckets_;
  std::vector<Piece> pieces_;  // every bucket's, in bucket order
  std::vector<int32_t> bucket_of_;
  bool checks_ = false;  // a scaler or max_norm: the updates wait for the whole gradient's check
  std::optional<GradientCheckPlan> check_;  // on the device, without release
  std::optional<LossScaler> scaler_;
  bool grads_moved_ = false;  // the check plan must be re-pointed before its next check
  std::vector<bool> handed_;    // in this step
  std::vector<bool> complete_;  // handed complete in this step: its pieces' work is posted
  // With release: K landing buffers (pinned, each the size of the largest
  // piece) that a bucket's later hands are copied into before the worker
  // adds them to the staging; piece p uses landing p % K. landing_busy_[k]:
  // an add from landing k is posted and not yet done.
  Buffer landing_storage_;
  std::vector<AccumulatePlan> piece_adds_;           // per piece: staging += its landing
  std::vector<std::vector<TensorView>> piece_landing_;  // per piece: its slices in its landing
  std::unique_ptr<std::atomic<bool>[]> landing_busy_;
  // With release and a check: each piece's check over its staged gradients
  // (on the host) and its partial (two doubles, GradientCheckOutputs::partial).
  std::vector<GradientCheckPlan> piece_checks_;
  std::vector<double> piece_partials_;
  std::vector<bool> piece_checked_;  // in this step
  // The step's timing: its start is set by the caller's thread at the first
  // hand, the rest by the worker (ordered by the worker's queue).
  int64_t step_began_ns_ = 0;
  OffloadStepTimes times_, last_times_;

  std::unique_ptr<detail::OffloadLanes> lanes_;
  std::unique_ptr<detail::HostWorker> worker_;  // last: destroyed first, with the lanes still there
};

using OffloadedAdam = Offloaded<Adam>;
using OffloadedLamb = Offloaded<Lamb>;

}  // namespace gradkit
