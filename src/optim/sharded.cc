#include "gradkit/optim/sharded.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#include "comm/stream_order.h"
#include "gradkit/core/error.h"
#include "gradkit/ops/blockwise.h"
#include "gradkit/optim/state_file.h"
#include "optim/hyperparameter_io.h"
#include "optim/moment_storage.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "Sharded";

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

// A dtype whose elements have `bytes` bytes, to move raw state elements.
DType dtype_of_size(size_t bytes) {
  return bytes == 8 ? DType::f64 : bytes == 4 ? DType::f32 : DType::bf16;
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

// What differs between the sharded optimizers: the state file's kinds,
// the state sections split like the weights (in the order the unsharded
// optimizer writes them), the options, and the update.
template <class Optimizer> struct Traits;

template <>
struct Traits<Adam> {
  static constexpr std::string_view kind = "adam";
  static constexpr std::string_view mixed_kind = "mixed_precision_adam";
  static constexpr std::string_view sections[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static const AdamOptions& options(const ShardedOptions& o) { return o.adam; }
  // amsgrad's maxima: kept by every rank or by none (the groups decide).
  static bool keeps(const Adam& adam, std::string_view section) {
    return section != "max_exp_avg_sq" || !adam.max_exp_avg_sq().empty();
  }
};

template <>
struct Traits<Lamb> {
  static constexpr std::string_view kind = "lamb";
  static constexpr std::string_view mixed_kind = "mixed_precision_lamb";
  static constexpr std::string_view sections[] = {"exp_avg", "exp_avg_sq"};
  static const LambOptions& options(const ShardedOptions& o) { return o.lamb; }
  static bool keeps(const Lamb&, std::string_view) { return true; }
};

// A state section split like the weights: its name, the bytes of one
// stored value, and the elements each stands for (1; 2 for 4-bit codes, two
// a byte; kQuantBlock or kQuant4Block for the absmax of 8- or 4-bit
// moments, one per block).
struct SplitSection {
  std::string_view name;
  size_t width;
  int64_t unit;
};

// The optimizer's split sections, in the order the unsharded one writes them.
template <class Optimizer>
std::vector<SplitSection> split_sections(const Optimizer& o) {
  const bool quantized = !o.exp_avg_absmax().empty();
  const int32_t bits = cut_bits(o);
  std::vector<SplitSection> out;
  for (std::string_view name : Traits<Optimizer>::sections) {
    out.push_back({name, dtype_size(o.exp_avg()[0].dtype), quantized ? elements_per_code_byte(bits) : 1});
  }
  if (quantized) {
    out.push_back({"exp_avg_absmax", sizeof(float), quant_block_of(bits)});
    out.push_back({"exp_avg_sq_absmax", sizeof(float), quant_block_of(bits)});
  }
  return out;
}

int64_t stored(int64_t elements, int64_t unit) { return (elements + unit - 1) / unit; }

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

template <class Optimizer>
void Sharded<Optimizer>::agree(bool ok, const std::string& what) {
  Buffer flag(comm_.device(), sizeof(double));
  const double mine = ok ? 0.0 : 1.0;
  copy_from_host(flag.data(), comm_.device(), &mine, sizeof mine);
  const TensorView view{flag.data(), 1, DType::f64, comm_.device()};
  comm_.all_reduce_buffer(view, view, ReduceOp::sum);
  comm_.wait();
  double failed = 0;
  copy_to_host(&failed, flag.data(), sizeof failed, comm_.device());
  if (failed == 0) return;
  throw Error(ErrorCode::io_error, ok ? std::string(kOp) + ": " + std::to_string(static_cast<int>(failed)) +
                                            " other rank(s) failed; see their error"
                                      : what);
}

namespace {

// Each tensor's first stored value in a section of the unsharded file
// (tensors back to back in group order, which is the layout's order; `unit`
// elements per value).
std::vector<int64_t> section_offsets(const ShardedLayout& layout, int64_t unit) {
  std::vector<int64_t> at(layout.numels.size() + 1, 0);
  for (size_t t = 0; t < layout.numels.size(); ++t) at[t + 1] = at[t] + stored(layout.numels[t], unit);
  return at;
}

}  // namespace

template <class Optimizer>
void Sharded<Optimizer>::save_to(StateFile& file) {
  comm_.wait();
  synchronize(comm_.device());
  // This rank's state, its pieces back to back, as its optimizers write it
  // (their sections concatenated in bucket order, the pieces' order).
  std::vector<StateFile> parts(parts_.size());
  for (size_t k = 0; k < parts_.size(); ++k) parts_[k].optimizer->save_to(parts[k]);
  const std::vector<SplitSection> sections = split_sections(*parts_[0].optimizer);
  StateFile mine;
  for (const SplitSection& section : sections) {
    std::vector<uint8_t> bytes;
    for (const StateFile& part : parts) {
      bytes.insert(bytes.end(), part.get(section.name).begin(), part.get(section.name).end());
    }
    mine.add(std::string(section.name), std::move(bytes));
  }
  mine.add("meta", parts[0].get("meta"));      // the same step count on every part
  mine.add("groups", parts[0].get("groups"));  // the hyperparameters (with its pieces' shapes)
  Buffer joined;
  const std::vector<TensorView> f32_masters = masters_.f32(joined, true);
  const StateSection master_section[] = {{"masters", &f32_masters}};
  if (mixed_) add_sections(mine, master_section);

  const bool root = comm_.rank() == 0;
  int64_t max_slice = 0;
  for (const ShardedLayout::Bucket& b : layout_.buckets) max_slice = std::max(max_slice, b.slice);
  // Every rank's pieces into the unsharded layout on rank 0, bucket by
  // bucket through one device buffer of a bucket's size. A section of
  // per-block values (unit > 1) is cut at the same places, divided by the
  // unit: the layout's slices and offsets are multiples of it then
  // (check_blocks_line_up).
  auto gather = [&](const SplitSection& section) {
    const size_t width = section.width;
    const int64_t unit = section.unit;
    const std::vector<int64_t> at = section_offsets(layout_, unit);
    const std::vector<uint8_t>& part = mine.get(section.name);
    std::vector<uint8_t> full(root ? static_cast<size_t>(at.back()) * width : 0);
    const int64_t max_values = stored(max_slice, unit) * layout_.world_size;
    Buffer staging(comm_.device(), static_cast<size_t>(max_values) * width);
    // The collectives move f16/bf16/f32/f64 elements: u8 codes go as 4-byte
    // words (their slices are multiples of kQuantBlock elements, a multiple of 4 bytes of 8- or 4-bit codes:
    // check_blocks_line_up).
    const size_t word = width == 1 ? 4 : width;
    const TensorView staged{staging.data(), max_values, dtype_of_size(word), comm_.device()};
    std::vector<uint8_t> host(static_cast<size_t>(max_values) * width);
    size_t from = 0;  // the next piece's bytes in `part`
    size_t next = 0;  // the next piece
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      const ShardedLayout::Bucket& bucket = layout_.buckets[b];
      const int64_t slice = stored(bucket.slice, unit);
      std::fill(host.begin(), host.end(), 0);
      for (; next < pieces_.size() && pieces_[next].bucket == b; ++next) {
        const size_t n = static_cast<size_t>(stored(pieces_[next].count, unit)) * width;
        std::memcpy(host.data() + static_cast<size_t>(pieces_[next].in_slice / unit) * width, part.data() + from, n);
        from += n;
      }
      const size_t slice_bytes = static_cast<size_t>(slice) * width;
      auto* device_slice = static_cast<unsigned char*>(staging.data()) + slice_bytes * static_cast<size_t>(comm_.rank());
      copy_from_host(device_slice, comm_.device(), host.data(), slice_bytes);
      const auto words = static_cast<int64_t>(slice_bytes / word);
      comm_.all_gather_buffer(TensorView{device_slice, words, staged.dtype, staged.device},
                              TensorView{staging.data(), words * layout_.world_size, staged.dtype, staged.device});
      comm_.wait();
      if (!root) continue;
      copy_to_host(host.data(), staging.data(), slice_bytes * static_cast<size_t>(layout_.world_size), comm_.device());
      for (size_t t = bucket.first; t < bucket.last; ++t) {
        std::memcpy(full.data() + static_cast<size_t>(at[t]) * width,
                    host.data() + static_cast<size_t>((layout_.offsets[t] - bucket.begin) / unit) * width,
                    static_cast<size_t>(stored(layout_.numels[t], unit)) * width);
      }
    }
    return full;
  };

  // The sections in the order the unsharded optimizer writes them, so that
  // the files are the same byte for byte.
  for (const SplitSection& section : sections) {
    const bool kept = Traits<Optimizer>::keeps(*parts_[0].optimizer, section.name);
    file.add(std::string(section.name), kept ? gather(section) : std::vector<uint8_t>());
  }
  std::vector<uint8_t> masters = mixed_ ? gather({"masters", sizeof(float), 1}) : std::vector<uint8_t>();
  if (!root) return;
  file.add("meta", mine.get("meta"));
  file.add("groups", write_groups(model_shapes_, read_groups(kOp, "", mine.get("groups"), shard_shapes_[0])));
  if (mixed_) file.add("masters", std::move(masters));
  if (mixed_ || scaler_.options().mode != LossScaling::none) file.add("scaler", scaler_section(scaler_));
}

template <class Optimizer>
void Sharded<Optimizer>::save(const std::string& path) {
  StateFile file;
  const std::string_view kind = mixed_ ? Traits<Optimizer>::mixed_kind : Traits<Optimizer>::kind;
  file.add("kind", std::vector<uint8_t>(kind.begin(), kind.end()));
  save_to(file);
  std::string error;
  if (comm_.rank() == 0) {
    try {
      file.write(path);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree(error.empty(), error);
}

template <class Optimizer>
typename Sharded<Optimizer>::ShardState Sharded<Optimizer>::shard_state(const std::string& path,
                                                                        const StateFile& file) const {
  // The file checked against the whole model, then cut to this rank's
  // pieces as a state file for each of its optimizers, which check the rest.
  ShardState shard;
  const auto hyper = read_groups(kOp, path, file.get("groups"), model_shapes_);
  auto cut = [&](const SplitSection& section, size_t first, size_t last) {
    const std::vector<int64_t> at = section_offsets(layout_, section.unit);
    const size_t width = section.width;
    const std::vector<uint8_t>& full = file.get(section.name);
    std::vector<uint8_t> part;
    if (full.empty() && section.name == "max_exp_avg_sq") return part;  // checked by Adam against its groups
    if (full.size() != static_cast<size_t>(at.back()) * width) {
      throw Error(ErrorCode::io_error, "state file '" + path + "' section '" + std::string(section.name) + "' has " +
                                           std::to_string(full.size()) + " bytes, expected " +
                                           std::to_string(static_cast<size_t>(at.back()) * width));
    }
    for (size_t k = first; k < last && k < pieces_.size(); ++k) {
      const ShardedLayout::Piece& p = pieces_[k];
      const auto* from = full.data() + static_cast<size_t>(at[p.tensor] + p.offset / section.unit) * width;
      part.insert(part.end(), from, from + static_cast<size_t>(stored(p.count, section.unit)) * width);
    }
    return part;
  };
  const std::vector<SplitSection> sections = split_sections(*parts_[0].optimizer);
  for (size_t k = 0; k < parts_.size(); ++k) {
    StateFile state;
    for (const SplitSection& section : sections) {
      state.add(std::string(section.name), cut(section, parts_[k].first, parts_[k].last));
    }
    state.add("meta", file.get("meta"));
    state.add("groups", write_groups(shard_shapes_[k], hyper));
    parts_[k].optimizer->check_state(path, state);
    shard.optimizers.push_back(std::move(state));
  }
  if (mixed_) {
    shard.rest.add("masters", cut({"masters", sizeof(float), 1}, 0, pieces_.size()));
    const std::vector<TensorView> shapes = masters_.file_shapes();
    const StateSection masters[] = {{"masters", &shapes}};
    check_sections(path, shard.rest, masters);
  }
  if (file.has("scaler")) {
    read_scaler_section(path, file, scaler_);
    shard.rest.add("scaler", file.get("scaler"));
  } else if (mixed_) {
    file.get("scaler");  // throws, naming the section
  }
  return shard;
}

template <class Optimizer>
void Sharded<Optimizer>::check_state(const std::string& path, const StateFile& file) const { shard_state(path, file); }

template <class Optimizer>
void Sharded<Optimizer>::apply_state(const StateFile& file) {
  const ShardState shard = shard_state("", file);
  for (size_t k = 0; k < parts_.size(); ++k) parts_[k].optimizer->apply_state(shard.optimizers[k]);
  if (shard.rest.has("scaler")) scaler_.set_state(read_scaler_section("", shard.rest, scaler_));
  if (mixed_) {
    Buffer loaded;
    const std::vector<TensorView> f32 = masters_.f32(loaded, false);
    const StateSection masters[] = {{"masters", &f32}};
    apply_sections(shard.rest, masters);
    // The model's weights (and remainders) from the loaded masters, on every rank.
    masters_.masters_written(f32);
    gather_weights({});
    comm_.wait();
  }
}

template <class Optimizer>
void Sharded<Optimizer>::load(const std::string& path) {
  StateFile file;
  std::string error;
  try {
    file = read_state(path, mixed_ ? Traits<Optimizer>::mixed_kind : Traits<Optimizer>::kind);
    check_state(path, file);
  } catch (const Error& e) {
    error = e.what();
  }
  agree(error.empty(), error);
  apply_state(file);
}

template class Sharded<Adam>;
template class Sharded<Lamb>;

}  // namespace gradkit
