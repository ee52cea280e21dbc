// Sharded<Adam or Lamb>: making it over a layout and a communicator, and its
// step (sharded_state.cc: its state files).
#include "gradkit/optim/sharded.h"

#include <algorithm>
#include <functional>
#include <string>
#include <type_traits>

#include "comm/stream_order.h"
#include "gradkit/core/error.h"
#include "gradkit/ops/low_bit.h"
#include "optim/moment_storage.h"
#include "optim/sharded_parts.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = detail::kShardedOp;
template <class Optimizer>
using Traits = detail::ShardedTraits<Optimizer>;

// The device scalars one step passes between its kernels, after the
// all-gathered partials (two doubles per rank).
struct Scalars {
  float grad_divisor;
  float global_norm;
  bool found_inf;
};

unsigned char* bytes_at(const TensorView& base, int64_t element) {
  return static_cast<unsigned char*>(base.data) + static_cast<size_t>(element) * dtype_size(base.dtype);
}

// Checks that `tensors` are views of one buffer laid out by `layout` (a
// GradientArena made from it) and returns that buffer's whole extent.
TensorView check_flat(std::string_view arg, const std::vector<TensorView>& tensors, const ShardedLayout& layout,
                      Device device) {
  const std::string name = "groups' " + std::string(arg);
  if (tensors.size() != layout.numels.size()) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, name,
                         "hold " + std::to_string(tensors.size()) + " tensors, expected " +
                             std::to_string(layout.numels.size()) + " (the layout's)");
  }
  const DType dtype = tensors[0].dtype;
  if (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16) {
    throw_argument_error(ErrorCode::dtype_unsupported, kOp, name,
                         "have dtype " + std::string(dtype_name(dtype)) + ", expected f32, f16 or bf16");
  }
  const size_t element = dtype_size(dtype);
  const auto* base = static_cast<const unsigned char*>(tensors[0].data) - static_cast<size_t>(layout.offsets[0]) * element;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    const std::string at = name + "[" + std::to_string(i) + "]";
    if (t.dtype != dtype) {
      throw_argument_error(ErrorCode::dtype_unsupported, kOp, at,
                           "has dtype " + std::string(dtype_name(t.dtype)) + ", expected " +
                               std::string(dtype_name(dtype)) + " (one dtype for the whole model)");
    }
    if (t.device != device) {
      throw_argument_error(ErrorCode::device_mismatch, kOp, at,
                           "is on " + to_string(t.device) + ", expected " + to_string(device) +
                               " (the communicator's device)");
    }
    if (t.numel != layout.numels[i]) {
      throw_argument_error(ErrorCode::size_mismatch, kOp, at,
                           "has " + std::to_string(t.numel) + " elements, expected " +
                               std::to_string(layout.numels[i]) + " (the layout's)");
    }
    if (t.data != base + static_cast<size_t>(layout.offsets[i]) * element) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, at,
                           "is not at element " + std::to_string(layout.offsets[i]) +
                               " of the buffer that holds tensor 0; expected views of one buffer laid out by the "
                               "layout (a GradientArena made from it)");
    }
  }
  return TensorView{const_cast<unsigned char*>(base), layout.total, dtype, device};
}

// The groups' shapes alone (numel and dtype of each param), as a state
// file's 'groups' section records them.
template <class Group>
std::vector<Group> shapes_of(const std::vector<Group>& groups, DType dtype) {
  std::vector<Group> out;
  for (const Group& g : groups) {
    Group shape;
    shape.hyperparameters = g.hyperparameters;
    for (const TensorView& p : g.params) shape.params.push_back(TensorView{nullptr, p.numel, dtype, Device::cpu()});
    out.push_back(std::move(shape));
  }
  return out;
}

// 8- and 4-bit moments are encoded in blocks of kQuantBlock (kQuant4Block)
// elements from each tensor's element 0: every shard must hold whole
// blocks. A layout whose alignment is a multiple of kQuantBlock gives both
// (kQuant4Block divides it; its tensor offsets,
// bucket starts and slices are multiples of the alignment), and its slices
// of u8 codes are then whole 4-byte words for the all-gathers.
void check_blocks_line_up(const ShardedLayout& layout, std::string_view option) {
  if (layout.alignment % kQuantBlock == 0) return;
  throw_argument_error(ErrorCode::invalid_argument, kOp, "layout.alignment",
                       "is " + std::to_string(layout.alignment) + " with 8- or 4-bit moments (" + std::string(option) +
                           " is u8); expected a multiple of " + std::to_string(kQuantBlock) +
                           " (kQuantBlock), so that no shard cuts a block: ShardedLayout::make(numels, world_size, "
                           "bucket_elements, 256)");
}

}  // namespace

template <class Optimizer>
Sharded<Optimizer>::Sharded(Communicator& comm, const ShardedLayout& layout, std::vector<Group> groups,
                            ShardedOptions options)
    : comm_(comm), layout_(layout), communication_stream_(options.communication_stream) {
  if (groups.empty()) throw_argument_error(ErrorCode::invalid_argument, kOp, "groups", "is empty; expected at least one group");
  layout_.validate(kOp);
  if (Traits<Optimizer>::options(options).moment_dtype == DType::u8) {
    check_blocks_line_up(layout_, std::is_same_v<Optimizer, Adam> ? "options.adam.moment_dtype" : "options.lamb.moment_dtype");
  }
  if (options.update_parts < 1) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "options.update_parts",
                         "is " + std::to_string(options.update_parts) + ", expected >= 1");
  }
  if (layout_.world_size != comm.size()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "layout",
                         "was made for " + std::to_string(layout_.world_size) + " ranks, expected comm.size() = " +
                             std::to_string(comm.size()));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].model_copy.empty()) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, "groups[" + std::to_string(g) + "].model_copy",
                           "is given; expected none (the params are the model's weights, which the step writes)");
    }
  }
  const ParameterLists lists = flatten_groups(kOp, groups);
  if (lists.params.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "groups", "hold no tensors; expected the model's");
  }
  const Device device = comm.device();
  weights_base_ = check_flat("params", lists.params, layout_, device);
  grads_base_ = check_flat("grads", lists.grads, layout_, device);
  mixed_ = weights_base_.dtype != DType::f32;
  if (mixed_) check_master_storage(kOp, options.master, groups);

  // This rank's pieces; a rank whose slices hold only padding keeps one
  // empty piece, so that its plans still know the device.
  pieces_ = layout_.pieces(comm.rank());
  std::vector<int32_t> group_of_piece;
  for (const ShardedLayout::Piece& p : pieces_) {
    const int64_t at = layout_.offsets[p.tensor] + p.offset;
    weight_pieces_.push_back(TensorView{bytes_at(weights_base_, at), p.count, weights_base_.dtype, device});
    grad_pieces_.push_back(TensorView{bytes_at(grads_base_, at), p.count, grads_base_.dtype, device});
    group_of_piece.push_back(lists.group_of_tensor[p.tensor]);
  }
  if (pieces_.empty()) {
    weight_pieces_.push_back(TensorView{weights_base_.data, 0, weights_base_.dtype, device});
    grad_pieces_.push_back(TensorView{grads_base_.data, 0, grads_base_.dtype, device});
    group_of_piece.push_back(0);
  }
  if (mixed_) masters_ = MasterStore(options.master, weight_pieces_);

  // The stages: consecutive buckets, about equal in slice elements, at
  // most update_parts of them; then one optimizer per stage over this
  // rank's pieces in it, so that the all-gathers of a stage's buckets can
  // start as soon as its update is done while the next stage is updated.
  int64_t slices = 0;
  for (const ShardedLayout::Bucket& bucket : layout_.buckets) slices += bucket.slice;
  const int64_t per_stage = std::max<int64_t>(1, (slices + options.update_parts - 1) / options.update_parts);
  int64_t in_stage = 0;
  for (size_t bucket = 0; bucket < layout_.buckets.size(); ++bucket) {
    in_stage += layout_.buckets[bucket].slice;
    if (in_stage >= per_stage || bucket + 1 == layout_.buckets.size()) {
      stage_ends_.push_back(bucket + 1);
      in_stage = 0;
    }
  }
  if (pieces_.empty()) {
    parts_.push_back({0, 0, 1, nullptr});  // the empty piece
  } else {
    size_t k = 0;
    for (size_t stage = 0; stage < stage_ends_.size(); ++stage) {
      const size_t first = k;
      while (k < pieces_.size() && pieces_[k].bucket < stage_ends_[stage]) ++k;
      if (k > first) parts_.push_back({stage, first, k, nullptr});
    }
  }
  model_shapes_ = shapes_of(groups, DType::f32);

  scalars_ = Buffer(device, 2 * sizeof(double) * static_cast<size_t>(comm.size()) + sizeof(Scalars));
  GradientCheckOptions check_options;
  check_options.norm = options.norm;
  check_options.max_norm = options.max_norm;
  check_ = GradientCheckPlan(grad_pieces_, check_options);
  scaler_ = LossScaler(device, options.scaler);
  for (Part& part : parts_) {
    std::vector<Group> shard_groups(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) shard_groups[g].hyperparameters = groups[g].hyperparameters;
    for (size_t k = part.first; k < part.last; ++k) {
      Group& g = shard_groups[static_cast<size_t>(group_of_piece[k])];
      if (mixed_) masters_.append_to(g, k, 1);
      else g.params.push_back(weight_pieces_[k]);
      g.grads.push_back(grad_pieces_[k]);
    }
    shard_shapes_.push_back(shapes_of(shard_groups, DType::f32));
    part.optimizer = std::make_unique<Optimizer>(std::move(shard_groups), Traits<Optimizer>::options(options));
  }
  for (const ShardedLayout::Bucket& b : layout_.buckets) readiness_.add_bucket(b.first, b.last);
  if constexpr (std::is_same_v<Optimizer, Lamb>) {
    // Each piece's slot in a row is its tensor (the one empty piece of a
    // rank without pieces: tensor 0, whose sums it leaves at 0).
    std::vector<int32_t> tensor_of_piece;
    for (const ShardedLayout::Piece& p : pieces_) tensor_of_piece.push_back(static_cast<int32_t>(p.tensor));
    if (pieces_.empty()) tensor_of_piece.push_back(0);
    piece_tensor_ = Buffer(device, tensor_of_piece.size() * sizeof(int32_t));
    copy_from_host(piece_tensor_.data(), device, tensor_of_piece.data(), tensor_of_piece.size() * sizeof(int32_t));
    tensor_sums_ = Buffer(device, 2 * sizeof(double) * layout_.numels.size() * static_cast<size_t>(comm.size()));
  }
}

template <class Optimizer>
Sharded<Optimizer>::~Sharded() = default;

template <class Optimizer>
TensorView Sharded<Optimizer>::slice(const TensorView& base, size_t bucket) const {
  return TensorView{bytes_at(base, layout_.slice_begin(bucket, comm_.rank())), layout_.buckets[bucket].slice, base.dtype,
                    base.device};
}

template <class Optimizer>
TensorView Sharded<Optimizer>::bucket_view(const TensorView& base, size_t bucket) const {
  const ShardedLayout::Bucket& b = layout_.buckets[bucket];
  return TensorView{bytes_at(base, b.begin), b.slice * layout_.world_size, base.dtype, base.device};
}

template <class Optimizer>
typename Sharded<Optimizer>::BucketViews Sharded<Optimizer>::bucket_views(const TensorView& base, size_t begin,
                                                                          size_t end) const {
  BucketViews views;
  for (size_t b = begin; b < end; ++b) {
    views.slices.push_back(slice(base, b));
    views.buckets.push_back(bucket_view(base, b));
  }
  return views;
}

template <class Optimizer>
void Sharded<Optimizer>::start(size_t bucket, Stream compute_stream) {
  if (comm_.device().is_cuda()) comm::stream_wait(comm_.device(), communication_stream_, compute_stream);
  comm_.reduce_scatter_buffer(bucket_view(grads_base_, bucket), slice(grads_base_, bucket), ReduceOp::average,
                              communication_stream_);
  readiness_.set_started(bucket);
}

template <class Optimizer>
void Sharded<Optimizer>::mark_ready(size_t tensor, Stream compute_stream) {
  if (const auto completed = readiness_.mark("Sharded::mark_ready", tensor)) {
    start(*completed, compute_stream);
    marked_ = true;
  }
}

template <class Optimizer>
void Sharded<Optimizer>::update(Stream stream, const bool* found_inf, const float* grad_divisor) {
  const Device device = comm_.device();
  LambStep lamb;  // LAMB: the global clipping is in the divisor (its own max_norm gets no norm)
  lamb.loss_scale_device = grad_divisor;
  lamb.found_inf = found_inf;
  const int64_t row = 2 * static_cast<int64_t>(layout_.numels.size());
  auto* rows = static_cast<double*>(tensor_sums_.data());
  auto index_of = [&](const Part& part) { return static_cast<const int32_t*>(piece_tensor_.data()) + part.first; };
  if constexpr (std::is_same_v<Optimizer, Lamb>) {
    // Pass 1 leaves this rank's sums of w^2 and d^2 per tensor in its row;
    // every rank's rows, added in rank order, give each tensor's ratio.
    for (const Part& part : parts_) {
      lamb.split = {LambPass::first, rows + row * comm_.rank(), index_of(part)};
      part.optimizer->step(stream, lamb);
    }
    comm_.all_gather_buffer(TensorView{rows + row * comm_.rank(), row, DType::f64, device},
                            TensorView{rows, row * comm_.size(), DType::f64, device}, stream);
  }
  // Stage by stage: the update of this rank's slices of the stage's
  // buckets on `stream`, then those buckets' all-gathers, in one call, on
  // the communication stream, where they overlap the next stage's update.
  // Every rank gathers the same buckets together, in order.
  size_t next = 0;  // the next part
  for (size_t stage = 0; stage < stage_ends_.size(); ++stage) {
    for (; next < parts_.size() && parts_[next].stage == stage; ++next) {
      Optimizer& optimizer = *parts_[next].optimizer;
      if constexpr (std::is_same_v<Optimizer, Adam>) {
        optimizer.step(stream, found_inf, grad_divisor);
      } else {
        lamb.split = {LambPass::second, rows, index_of(parts_[next]), comm_.size(), row};
        optimizer.step(stream, lamb);
      }
    }
    const BucketViews gathered =
        bucket_views(weights_base_, stage == 0 ? 0 : stage_ends_[stage - 1], stage_ends_[stage]);
    if (device.is_cuda()) comm::stream_wait(device, communication_stream_, stream);
    comm_.all_gather_buffers(gathered.slices, gathered.buckets, communication_stream_);
  }
  if (device.is_cuda()) comm::stream_wait(device, stream, communication_stream_);
}

template <class Optimizer>
void Sharded<Optimizer>::gather_weights(Stream stream) {
  const BucketViews all = bucket_views(weights_base_, 0, layout_.buckets.size());
  comm_.all_gather_buffers(all.slices, all.buckets, stream);
}

template <class Optimizer>
void Sharded<Optimizer>::step(Stream stream) {
  std::vector<TensorView> buckets, slices;  // the buckets stage 2 has not reduce-scattered: all at once
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    if (readiness_.started(b)) continue;
    buckets.push_back(bucket_view(grads_base_, b));
    slices.push_back(slice(grads_base_, b));
  }
  comm_.reduce_scatter_buffers(buckets, slices, ReduceOp::average, stream);
  if (marked_ && comm_.device().is_cuda()) comm::stream_wait(comm_.device(), stream, communication_stream_);
  readiness_.reset();
  marked_ = false;

  const int rank = comm_.rank(), ranks = comm_.size();
  const Device device = comm_.device();
  auto* partials = static_cast<double*>(scalars_.data());
  auto* s = reinterpret_cast<Scalars*>(partials + 2 * ranks);
  check_.check({.partial = partials + 2 * rank}, 1.0f, scaler_.scale_device(), stream);
  comm_.all_gather_buffer(TensorView{partials + 2 * rank, 2, DType::f64, device},
                          TensorView{partials, 2 * ranks, DType::f64, device}, stream);
  check_.combine(partials, ranks, {.found_inf = &s->found_inf, .grad_divisor = &s->grad_divisor,
                                   .global_norm = &s->global_norm},
                 1.0f, scaler_.scale_device(), stream);
  update(stream, &s->found_inf, &s->grad_divisor);  // and the all-gathers
  scaler_.update(&s->found_inf, stream);
}

template <class Optimizer>
float Sharded<Optimizer>::loss_scale() const { return scaler_.state().scale; }

template <class Optimizer>
bool Sharded<Optimizer>::last_step_skipped() const {
  Scalars s{};
  copy_to_host(&s, static_cast<double*>(scalars_.data()) + 2 * comm_.size(), sizeof s, scalars_.device());
  return s.found_inf;
}

template <class Optimizer>
float Sharded<Optimizer>::last_grad_norm() const {
  Scalars s{};
  copy_to_host(&s, static_cast<double*>(scalars_.data()) + 2 * comm_.size(), sizeof s, scalars_.device());
  return s.global_norm;
}


template <class Optimizer>
size_t Sharded<Optimizer>::state_bytes() const {
  size_t bytes = masters_.bytes();
  for (const Part& part : parts_) {
    for (const TensorView& t : part.optimizer->exp_avg()) bytes += 2 * t.bytes();  // and exp_avg_sq
    for (const TensorView& t : part.optimizer->exp_avg_absmax()) bytes += 2 * t.bytes();  // 8-bit moments
    if constexpr (std::is_same_v<Optimizer, Adam>) {
      for (const TensorView& t : part.optimizer->max_exp_avg_sq()) bytes += t.bytes();
    }
  }
  return bytes;
}

template <class Optimizer>
void Sharded<Optimizer>::for_each_optimizer(const std::function<void(Optimizer&)>& fn) {
  for (Part& part : parts_) fn(*part.optimizer);
}

template class Sharded<Adam>;
template class Sharded<Lamb>;

}  // namespace gradkit
