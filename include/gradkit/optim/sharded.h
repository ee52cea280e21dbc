// Adam or LAMB with its state split across the ranks of a communicator (ZeRO
// stages 1 and 2): each rank keeps the f32 master weights and the moments of
// its shard alone (ShardedLayout: its slice of every bucket). One step:
// reduce-scatter of the gradients (average) into each rank's slices, in
// place; the mixed-precision check of the shard with the Inf/NaN flags and
// the norms' partials of all ranks combined in one small all-gather, so
// every rank takes the same skip and clip decision; the update of the shard
// (LAMB: pass 1, one small all-gather of every tensor's sums of w^2 and d^2,
// the trust ratios from all ranks' sums added in rank order, pass 2), bucket
// by bucket, each bucket's all-gather of the updated weights into the
// model's weights (in place) overlapping the next bucket's update; the loss
// scaler's update. Stage 2: mark_ready() reduce-scatters a bucket as soon
// as backward has produced all of its gradients.
//
// Adam is element-wise, so its weights are bitwise those of the unsharded
// step (Adam, or MixedPrecision<Adam> for f16/bf16 models) on the same
// averaged gradients. LAMB's moments are bitwise those of the unsharded step;
// its trust ratios, like the clipping norm, are summed in another order and
// agree to f64 rounding. docs/ops.md ("ShardedLayout and Sharded<Adam or
// Lamb>") states exactly what it computes.
#pragma once

#include <concepts>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gradkit/comm/gradient_arena.h"
#include "gradkit/ops/grad_check.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/loss_scaler.h"
#include "gradkit/optim/master_storage.h"
#include "gradkit/optim/state_file.h"

namespace gradkit {

struct ShardedOptions {
  // No loss scale by default (f32 or bf16 models); dynamic for f16 models
  // whose loss is scaled. Steps with Inf/NaN gradients are skipped either way.
  LossScalerOptions scaler = {.mode = LossScaling::none};
  float max_norm = 0.0f;  // > 0: clip the global norm of the unscaled gradients (clip_grad_norm_)
  NormType norm = NormType::l2;
  AdamOptions adam;  // the sharded optimizer's own options: Adam's
  LambOptions lamb;  // or LAMB's
  // Where mark_ready() reduce-scatters a completed bucket, and where step()
  // all-gathers each bucket's weights as soon as its update is done, while
  // the next bucket is updated on the step's stream (NCCL; events order
  // the two streams, and the step's stream waits for this one at the end).
  Stream communication_stream = {};
  // The update of this rank's shard runs in at most this many launches (>=
  // 1), each over whole buckets; the buckets of one are all-gathered while
  // the next is updated. More hide more of the update behind the
  // all-gathers, but each launch pays a ramp-up and a tail (measured:
  // bench/log/2026-11-23.md, "The sharded step on one rank").
  int update_parts = 8;
  // f16/bf16 models: each rank keeps its shard's f32 masters as f32 tensors,
  // or (bf16 models) as i16 remainders completing the model's bf16 weights
  // of its shard, 2 bytes a parameter instead of 4 (docs/ops.md, "the
  // remainder master"); the masters are the same bit for bit. Ignored for
  // f32 models.
  MasterStorage master = MasterStorage::f32;
};

template <class Optimizer>
class Sharded {
 public:
  using Group = typename Optimizer::Group;

  // `groups` (the optimizer's groups) hold the whole model, in the tensor
  // order of `layout` (group 0's tensors first): `params` are the model's weights (f32, or f16/bf16 with
  // f32 masters kept for the shard), views of one buffer at the layout's
  // offsets (a GradientArena made from `layout`); `grads` likewise, in a
  // second such buffer (f32, f16 or bf16); `model_copy` empty. Both buffers
  // hold layout.total elements, on comm.device(), and every rank passes the
  // same weights. layout.world_size must be comm.size(); with 8-bit
  // moments (u8 moment_dtype) layout.alignment a multiple of kQuantBlock,
  // so that every shard holds whole blocks. Validates all of it, naming the
  // argument, before allocating the shard's state.
  Sharded(Communicator& comm, const ShardedLayout& layout, std::vector<Group> groups, ShardedOptions options = {});
  ~Sharded();
  Sharded(const Sharded&) = delete;
  Sharded& operator=(const Sharded&) = delete;

  // Stage 2: tensor `tensor`'s gradient is final once the work queued so far
  // on `compute_stream` has run; a bucket whose gradients are all final is
  // reduce-scattered at once (on options.communication_stream). Every rank
  // marks in the same order. Marking one twice in a step is an error.
  void mark_ready(size_t tensor, Stream compute_stream = {});
  // One step on `stream`: the buckets not reduce-scattered yet (all of them
  // in stage 1), the check, the update and the all-gather bucket by bucket,
  // the scaler.
  void step(Stream stream = {});

  const float* loss_scale_device() const { return scaler_.scale_device(); }  // S, a float on the device
  float loss_scale() const;         // synchronous reads
  bool last_step_skipped() const;
  float last_grad_norm() const;     // unscaled global norm of the last step, all ranks
  int64_t step_count() const { return parts_[0].optimizer->step_count(); }
  // Adam's per-group learning rates; LAMB's eta. Synchronous. (Member
  // templates, so that the explicit instantiations in sharded.cc leave out
  // the other optimizer's: clang before 16 instantiates a constrained
  // member whose constraint fails.)
  template <class O = Optimizer> requires std::same_as<O, Adam>
  float lr(int group) const { return parts_[0].optimizer->lr(group); }
  template <class O = Optimizer> requires std::same_as<O, Adam>
  void set_lr(int group, float lr) {
    for_each_optimizer([&](Optimizer& o) { o.set_lr(group, lr); });
  }
  template <class O = Optimizer> requires std::same_as<O, Lamb>
  float eta() const { return parts_[0].optimizer->eta(); }
  template <class O = Optimizer> requires std::same_as<O, Lamb>
  void set_eta(float eta) {
    for_each_optimizer([&](Optimizer& o) { o.set_eta(eta); });
  }

  const ShardedLayout& layout() const { return layout_; }
  Device device() const { return comm_.device(); }
  const std::vector<ShardedLayout::Piece>& pieces() const { return pieces_; }  // this rank's
  // Bytes of optimizer state this rank holds: masters (f16/bf16 models) and
  // moments of its shard.
  size_t state_bytes() const;
  // Per piece: the f32 masters (empty for f32 models and for remainder
  // masters), and the remainders (empty unless options.master is remainder).
  const std::vector<TensorView>& masters() const { return masters_.masters(); }
  const std::vector<TensorView>& weight_remainders() const { return masters_.remainders(); }

  // The state in the unsharded optimizer's file format (the optimizer's for
  // f32 models, MixedPrecision's for f16/bf16), so a file moves between
  // sharded and unsharded runs and between rank counts. Collective: every
  // rank calls it; rank 0 writes the file, and every rank throws if it
  // could not. load: every rank reads the file and takes its pieces; every
  // rank checks the file against the whole model before any rank writes
  // anything, and all throw if any rank could not load.
  void save(const std::string& path);
  void load(const std::string& path);

  // The same state as sections of a larger file (a training checkpoint's).
  // save_to is collective and adds the sections on rank 0 only (the other
  // ranks' `file` is left as it was). check_state (this rank only) throws
  // io_error unless the file fits the whole model; apply_state (after
  // check_state, on every rank: collective for f16/bf16 models, whose
  // weights are rewritten from the loaded masters) takes this rank's pieces.
  void save_to(StateFile& file);
  void check_state(const std::string& path, const StateFile& file) const;
  void apply_state(const StateFile& file);

 private:
  void start(size_t bucket, Stream compute_stream);
  TensorView slice(const TensorView& base, size_t bucket) const;
  TensorView bucket_view(const TensorView& base, size_t bucket) const;
  // Buckets [begin, end) of `base`: this rank's slices and the whole
  // buckets, as one all_gather_buffers call takes them.
  struct BucketViews {
    std::vector<TensorView> slices, buckets;
  };
  BucketViews bucket_views(const TensorView& base, size_t begin, size_t end) const;
  void gather_weights(Stream stream);
  // The optimizer's update of the shard with the check's divisor and flag.
  void update(Stream stream, const bool* found_inf, const float* grad_divisor);
  // The file's state for this rank's pieces: a state file for each of its
  // optimizers, and the masters and scaler; throws io_error unless the file
  // fits the whole model.
  struct ShardState {
    std::vector<StateFile> optimizers;
    StateFile rest;
  };
  ShardState shard_state(const std::string& path, const StateFile& file) const;
  void for_each_optimizer(const std::function<void(Optimizer&)>& fn);
  // Throws on every rank unless every rank's `ok` is true.
  void agree(bool ok, const std::string& what);

  Communicator& comm_;
  ShardedLayout layout_;
  std::vector<ShardedLayout::Piece> pieces_;
  // The shapes a state file's 'groups' section records: the whole model's
  // (the unsharded optimizer's) and each of this rank's optimizers'.
  std::vector<Group> model_shapes_;
  std::vector<std::vector<Group>> shard_shapes_;
  TensorView weights_base_;        // the flat buffers: layout.total elements each
  TensorView grads_base_;
  Stream communication_stream_;
  bool mixed_ = false;             // f16/bf16 weights with f32 masters
  bool marked_ = false;            // a bucket was started by mark_ready in this step
  std::vector<TensorView> weight_pieces_, grad_pieces_;
  MasterStore masters_;            // f16/bf16 models: the masters of weight_pieces_
  Buffer scalars_;                 // the all-gathered partials, then divisor, norm, found-inf
  GradientCheckPlan check_;
  LossScaler scaler_;
  // The update's stages, the same on every rank (so that every rank issues
  // the same all-gathers together): stage s covers the buckets up to
  // stage_ends_[s], at most options.update_parts of them, about equal in
  // slice elements.
  std::vector<size_t> stage_ends_;
  // This rank's optimizers: one per stage it holds pieces in, over the
  // pieces [first, last) (one over the empty piece of a rank without any).
  struct Part {
    size_t stage;
    size_t first, last;
    std::unique_ptr<Optimizer> optimizer;
  };
  std::vector<Part> parts_;
  detail::BucketReadiness readiness_;
  // LAMB: every rank's row of per-tensor sums (w^2, d^2), and each piece's
  // tensor (its slot in a row).
  Buffer tensor_sums_;
  Buffer piece_tensor_;
};

using ShardedAdam = Sharded<Adam>;
using ShardedLamb = Sharded<Lamb>;

}  // namespace gradkit
