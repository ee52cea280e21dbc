// Offloaded<Adam or Lamb>: checking its arguments, laying out its host
// memory and cutting the parameters into buckets and pieces.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "gradkit/core/error.h"
#include "gradkit/ops/low_bit.h"
#include "optim/moment_storage.h"
#include "optim/offloaded_parts.h"

namespace gradkit {
namespace {

bool float_dtype(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

template <class Group>
std::string tensor_name(const std::vector<Group>& groups, size_t flat, const char* list) {
  for (size_t g = 0; g < groups.size(); ++g) {
    if (flat < groups[g].params.size()) {
      return "groups[" + std::to_string(g) + "]." + list + "[" + std::to_string(flat) + "]";
    }
    flat -= groups[g].params.size();
  }
  return list;
}

// Everything that can be checked without touching a device: where each
// tensor says it is, its dtype, and the options. Throws naming the argument.
template <class Optimizer>
void check_arguments(const std::vector<typename Optimizer::Group>& groups, const ParameterLists& lists,
                     const OffloadedOptions& options) {
  using Traits = OffloadTraits<Optimizer>;
  const std::string_view op = Traits::op;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string name = "groups[" + std::to_string(g) + "]";
    if (!groups[g].model_copy.empty()) {
      throw_argument_error(ErrorCode::invalid_argument, op, name + ".model_copy",
                           "is given; expected none (the params are the model's weights, which the step writes)");
    }
    if (!groups[g].weight_remainder.empty()) {
      throw_argument_error(ErrorCode::invalid_argument, op, name + ".weight_remainder",
                           "is given; expected none (the f32 masters are kept on the host)");
    }
    validate(groups[g].hyperparameters, op, name + ".hyperparameters");
  }
  if constexpr (std::is_same_v<Optimizer, Lamb>) {
    validate_eta(options.lamb.eta, op, "options.lamb.eta");
  }
  if (lists.params.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, op, "groups", "hold no params; expected at least one");
  }
  const TensorView& first = lists.params[0];
  if (!first.device.is_cuda()) {
    throw_argument_error(ErrorCode::device_mismatch, op, tensor_name(groups, 0, "params"),
                         "is on cpu, expected a CUDA device (the model's weights and gradients stay on the GPU; "
                         "the optimizer's state goes to the host)");
  }
  if (!float_dtype(first.dtype)) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, tensor_name(groups, 0, "params"),
                         "has dtype " + std::string(dtype_name(first.dtype)) + ", expected f32, f16 or bf16");
  }
  if (!float_dtype(lists.grads[0].dtype)) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, tensor_name(groups, 0, "grads"),
                         "has dtype " + std::string(dtype_name(lists.grads[0].dtype)) + ", expected f32, f16 or bf16");
  }
  for (size_t i = 0; i < lists.params.size(); ++i) {
    const std::pair<const TensorView*, const char*> both[] = {{&lists.params[i], "params"}, {&lists.grads[i], "grads"}};
    for (const auto& [t, list] : both) {
      if (t->device != first.device) {
        throw_argument_error(ErrorCode::device_mismatch, op, tensor_name(groups, i, list),
                             "is on " + to_string(t->device) + ", expected " + to_string(first.device) + " (" +
                                 tensor_name(groups, 0, "params") + "'s device: one device for everything)");
      }
      const DType want = t == &lists.params[i] ? first.dtype : lists.grads[0].dtype;
      if (t->dtype != want) {
        throw_argument_error(ErrorCode::dtype_unsupported, op, tensor_name(groups, i, list),
                             "has dtype " + std::string(dtype_name(t->dtype)) + ", expected " +
                                 std::string(dtype_name(want)) + " (one dtype per list)");
      }
    }
  }
  const DType md = Traits::options(options).moment_dtype;
  if (md != DType::f32 && md != DType::bf16 && md != DType::u8) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, Traits::moment_option,
                         "is " + std::string(dtype_name(md)) + ", expected f32, bf16 or u8");
  }
  if (!(std::isfinite(options.max_norm) && options.max_norm >= 0)) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.max_norm",
                         "is " + std::to_string(options.max_norm) + ", expected a finite value >= 0 (0: no clipping)");
  }
  if (options.host_threads < 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.host_threads",
                         "is " + std::to_string(options.host_threads) + ", expected >= 0 (0: every core but two)");
  }
  if (options.buckets.empty() && options.bucket_bytes == 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.bucket_bytes", "is 0, expected > 0");
  }
  if (options.piece_bytes == 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.piece_bytes", "is 0, expected > 0");
  }
}

// Each tensor's bucket: the caller's, checked, or cut from the last tensor
// to the first at `bucket_bytes` of gradients.
std::vector<int32_t> assign_buckets(std::string_view op, const std::vector<TensorView>& grads,
                                    const OffloadedOptions& options) {
  const size_t n = grads.size();
  if (!options.buckets.empty()) {
    if (options.buckets.size() != n) {
      throw_argument_error(ErrorCode::size_mismatch, op, "options.buckets",
                           "has " + std::to_string(options.buckets.size()) + " entries, expected " + std::to_string(n) +
                               " (one per param)");
    }
    const int32_t largest = *std::max_element(options.buckets.begin(), options.buckets.end());
    std::vector<bool> used(static_cast<size_t>(std::max(largest, 0)) + 1, false);
    for (size_t i = 0; i < n; ++i) {
      if (options.buckets[i] < 0) {
        throw_argument_error(ErrorCode::invalid_argument, op, "options.buckets[" + std::to_string(i) + "]",
                             "is " + std::to_string(options.buckets[i]) + ", expected a bucket index >= 0");
      }
      used[static_cast<size_t>(options.buckets[i])] = true;
    }
    for (size_t b = 0; b < used.size(); ++b) {
      if (!used[b]) {
        throw_argument_error(ErrorCode::invalid_argument, op, "options.buckets",
                             "uses no tensor for bucket " + std::to_string(b) + "; expected every bucket from 0 to " +
                                 std::to_string(largest) + " to hold one");
      }
    }
    return options.buckets;
  }
  std::vector<int32_t> out(n);
  int32_t bucket = 0;
  size_t filled = 0;
  for (size_t k = n; k-- > 0;) {
    if (filled >= options.bucket_bytes) {
      ++bucket;
      filled = 0;
    }
    out[k] = bucket;
    filled += grads[k].bytes();
  }
  return out;
}

// Elements [offset, offset + count) of `v`.
TensorView slice(const TensorView& v, int64_t offset, int64_t count) {
  TensorView out = v;
  out.data = static_cast<char*>(v.data) + static_cast<size_t>(offset) * dtype_size(v.dtype);
  out.numel = count;
  return out;
}

// Each slice's part of a per-tensor list (empty stays empty) whose values
// stand for `unit` elements each: 1, 2 (4-bit codes, two a byte), or a
// quantization block (absmax). Slices start on kQuantBlock boundaries,
// multiples of every unit.
std::vector<TensorView> pick(const std::vector<TensorView>& all, const std::vector<OffloadSlice>& slices,
                             int64_t unit = 1) {
  std::vector<TensorView> out;
  if (all.empty()) return out;
  for (const OffloadSlice& s : slices) out.push_back(slice(all[s.tensor], s.offset / unit, (s.count + unit - 1) / unit));
  return out;
}

// The CPU step of one piece: a plan over its slices of the host tensors.
AdamPlan piece_plan(const Adam& adam, const std::vector<OffloadSlice>& piece, const std::vector<TensorView>& masters,
                    const std::vector<TensorView>& grads, const std::vector<TensorView>& copies,
                    std::span<const AdamHyperparameters> hyper, const std::vector<int32_t>& group_of) {
  const int32_t bits = cut_bits(adam);
  const int64_t code_unit = elements_per_code_byte(bits), block = quant_block_of(bits);
  const auto w = pick(masters, piece), g = pick(grads, piece), c = pick(copies, piece),
             m = pick(adam.exp_avg(), piece, code_unit), v = pick(adam.exp_avg_sq(), piece, code_unit),
             vmax = pick(adam.max_exp_avg_sq(), piece), m_absmax = pick(adam.exp_avg_absmax(), piece, block),
             v_absmax = pick(adam.exp_avg_sq_absmax(), piece, block);
  AdamTensors tensors{w, g, m, v, vmax, c, m_absmax, v_absmax, {}};
  tensors.moment_bits = bits;
  return AdamPlan(tensors, hyper, group_of);
}

LambPlan piece_plan(const Lamb& lamb, const std::vector<OffloadSlice>& piece, const std::vector<TensorView>& masters,
                    const std::vector<TensorView>& grads, const std::vector<TensorView>& copies,
                    std::span<const LambHyperparameters> hyper, const std::vector<int32_t>& group_of) {
  const int32_t bits = cut_bits(lamb);
  const int64_t code_unit = elements_per_code_byte(bits), block = quant_block_of(bits);
  const auto w = pick(masters, piece), g = pick(grads, piece), c = pick(copies, piece),
             m = pick(lamb.exp_avg(), piece, code_unit), v = pick(lamb.exp_avg_sq(), piece, code_unit),
             m_absmax = pick(lamb.exp_avg_absmax(), piece, block), v_absmax = pick(lamb.exp_avg_sq_absmax(), piece, block);
  return LambPlan(LambTensors{w, g, m, v, c, {}, m_absmax, v_absmax, {}, bits}, hyper, group_of);
}

}  // namespace

std::vector<std::vector<OffloadSlice>> cut_pieces(const std::vector<size_t>& tensors, const std::vector<TensorView>& grads,
                                                  size_t piece_bytes, int64_t align) {
  std::vector<std::vector<OffloadSlice>> pieces(1);
  size_t filled = 0;
  auto close = [&] {
    if (!pieces.back().empty()) pieces.emplace_back();
    filled = 0;
  };
  for (size_t t : tensors) {
    const int64_t n = grads[t].numel;
    const auto size = static_cast<int64_t>(dtype_size(grads[t].dtype));
    const int64_t unit = align > 0 ? align : std::max<int64_t>(n, 1);  // 0: the whole tensor
    for (int64_t at = 0; at < n;) {
      const auto room = static_cast<int64_t>((piece_bytes - filled) / static_cast<size_t>(size));
      int64_t take = n - at;
      if (take > room) {
        take = room / unit * unit;  // cut at a block boundary
        if (take == 0 && filled > 0) {  // no whole block fits: begin the next piece
          close();
          continue;
        }
        take = std::max(take, std::min(unit, n - at));  // a piece holds at least one block
      }
      pieces.back().push_back({t, at, take});
      at += take;
      filled += static_cast<size_t>(take * size);
      if (filled >= piece_bytes) close();
    }
  }
  if (pieces.back().empty()) pieces.pop_back();
  return pieces;
}

template <class Optimizer>
Offloaded<Optimizer>::Offloaded(std::vector<Group> groups, OffloadedOptions options)
    : groups_(std::move(groups)), options_(std::move(options)) {
  using Traits = OffloadTraits<Optimizer>;
  const std::string_view op = Traits::op;
  if (groups_.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, op, "groups", "is empty; expected at least one group");
  }
  const ParameterLists lists = flatten_groups(op, groups_);
  check_arguments<Optimizer>(groups_, lists, options_);
  bucket_of_ = assign_buckets(op, lists.grads, options_);
  params_ = lists.params;
  grads_ = lists.grads;
  device_ = lists.device;
  low_precision_ = params_[0].dtype != DType::f32;

  // What needs the device: the lanes (backend_unavailable without CUDA),
  // then the tensors' memory checked where it lies (null pointers,
  // overlaps, host memory passed as device memory) by a plan over them.
  const int num_buckets = *std::max_element(bucket_of_.begin(), bucket_of_.end()) + 1;
  buckets_.resize(static_cast<size_t>(num_buckets));
  for (size_t i = 0; i < bucket_of_.size(); ++i) buckets_[static_cast<size_t>(bucket_of_[i])].tensors.push_back(i);
  std::vector<std::vector<OffloadSlice>> slices;
  for (Bucket& b : buckets_) {
    for (auto& piece : cut_pieces(b.tensors, grads_, options_.piece_bytes, Traits::cuts_tensors ? kQuantBlock : 0)) {
      b.pieces.push_back(static_cast<int>(slices.size()));
      slices.push_back(std::move(piece));
    }
  }
  lanes_ = std::make_unique<detail::OffloadLanes>(op, device_, static_cast<int>(slices.size()) + 1);
  const PlanList device_lists[] = {{"params", params_, true}, {"grads", grads_, false}};
  (void)MultiTensorPlan(op, device_lists);
  GradientCheckOptions check_options;
  check_options.norm = options_.norm;
  check_options.max_norm = options_.max_norm;
  checks_ = options_.scaler || options_.max_norm > 0;
  if (checks_) {
    // With release the check runs on the host, over the staged gradients (the pieces' checks, below).
    if (!options_.release) check_.emplace(grads_, check_options);
    if (options_.scaler) scaler_.emplace(device_, *options_.scaler);
    scalars_device_ = Buffer(device_, sizeof(OffloadScalars));
  }

  // Host memory. Masters are pinned when the copy-back reads them (f32
  // weights); moments never cross the bus and stay in ordinary memory.
  masters_storage_ = low_precision_ ? allocate_moments(Device::cpu(), params_, DType::f32, 1)
                                    : allocate_pinned_moments(params_, DType::f32, 1);
  masters_ = moment_views(masters_storage_, params_, DType::f32, 1, 0);
  grad_staging_ = allocate_pinned_moments(grads_, grads_[0].dtype, 1);
  staged_grads_ = moment_views(grad_staging_, grads_, grads_[0].dtype, 1, 0);
  scalars_host_ = Buffer::pinned(sizeof(OffloadScalars));
  if (low_precision_ && Traits::copy_over_gradient && grads_[0].dtype == params_[0].dtype) {
    // Adam reads each element's gradient once, before it writes that element's
    // model copy, so the copy may take the gradient's place in the staging
    // (the plans allow a written list to be the identical tensor of a list
    // only read): 2 bytes per parameter less on the host. A skipped step
    // writes no copy, and so copies nothing back (post_update).
    staged_copies_ = staged_grads_;
  } else if (low_precision_) {
    copy_staging_ = allocate_pinned_moments(params_, params_[0].dtype, 1);
    staged_copies_ = moment_views(copy_staging_, params_, params_[0].dtype, 1, 0);
  }
  refresh_masters();

  std::vector<Group> host_groups = groups_;
  std::vector<decltype(Group{}.hyperparameters)> hyper;
  size_t at = 0;
  for (Group& g : host_groups) {
    hyper.push_back(g.hyperparameters);
    for (size_t i = 0; i < g.params.size(); ++i, ++at) {
      g.params[i] = masters_[at];
      g.grads[i] = staged_grads_[at];
      if (low_precision_) g.model_copy.push_back(staged_copies_[at]);
    }
  }
  optimizer_ = std::make_unique<Optimizer>(host_groups, Traits::options(options_));
  groups_ = std::move(host_groups);

  for (std::vector<OffloadSlice>& piece : slices) {
    std::vector<int32_t> group_of;
    for (const OffloadSlice& s : piece) group_of.push_back(lists.group_of_tensor[s.tensor]);
    typename Traits::Plan plan = piece_plan(*optimizer_, piece, masters_, staged_grads_, staged_copies_, hyper, group_of);
    pieces_.push_back({std::move(piece), std::move(plan)});
  }
  if (options_.release) prepare_release(check_options);
  handed_.assign(buckets_.size(), false);
  complete_.assign(buckets_.size(), false);
  worker_ = std::make_unique<detail::HostWorker>();
  worker_->post([threads = options_.host_threads] { detail::set_host_threads(threads); });
}

template <class Optimizer>
void Offloaded<Optimizer>::prepare_release(const GradientCheckOptions& check_options) {
  // The landings: piece p's later hands land in landing p % kLandings, laid
  // out as the piece's slices, before the worker adds them to the staging.
  size_t largest = 0;
  std::vector<size_t> piece_bytes;
  for (const Piece& p : pieces_) {
    size_t bytes = 0;
    for (const OffloadSlice& s : p.slices) bytes += static_cast<size_t>(s.count) * dtype_size(grads_[s.tensor].dtype);
    piece_bytes.push_back(bytes);
    largest = std::max(largest, bytes);
  }
  const size_t landings = std::min<size_t>(kLandings, pieces_.size());
  const size_t stride = (largest + 255) / 256 * 256;
  landing_storage_ = Buffer::pinned(landings * stride);
  landing_busy_ = std::make_unique<std::atomic<bool>[]>(landings);
  for (size_t p = 0; p < pieces_.size(); ++p) {
    std::vector<TensorView> landing;
    size_t at = (p % landings) * stride;
    for (const OffloadSlice& s : pieces_[p].slices) {
      landing.push_back(landing_storage_.view(grads_[s.tensor].dtype, at, s.count));
      at += static_cast<size_t>(s.count) * dtype_size(grads_[s.tensor].dtype);
    }
    const std::vector<TensorView> staged = pick(staged_grads_, pieces_[p].slices);
    piece_adds_.emplace_back(staged, landing);
    piece_landing_.push_back(std::move(landing));
    if (checks_) piece_checks_.emplace_back(staged, check_options);
  }
  piece_partials_.assign(2 * pieces_.size(), 0.0);
  piece_checked_.assign(pieces_.size(), false);
}

template <class Optimizer>
Offloaded<Optimizer>::~Offloaded() {
  try {
    if (worker_) worker_->wait();
  } catch (...) {  // an error nobody asked for any more: the destructor must not throw
  }
}

template <class Optimizer>
int Offloaded<Optimizer>::num_buckets() const {
  return static_cast<int>(buckets_.size());
}

template <class Optimizer>
std::span<const int32_t> Offloaded<Optimizer>::bucket_of_tensor() const {
  return bucket_of_;
}

template <class Optimizer>
std::span<const size_t> Offloaded<Optimizer>::bucket_tensors(int bucket) const {
  if (bucket < 0 || bucket >= num_buckets()) {
    throw_argument_error(ErrorCode::invalid_argument, OffloadTraits<Optimizer>::op, "bucket",
                         "is " + std::to_string(bucket) + ", expected an index in [0, " +
                             std::to_string(num_buckets()) + ")");
  }
  return buckets_[static_cast<size_t>(bucket)].tensors;
}

template <class Optimizer>
size_t Offloaded<Optimizer>::host_bytes() const {
  return masters_storage_.bytes() + grad_staging_.bytes() + copy_staging_.bytes() + scalars_host_.bytes() +
         landing_storage_.bytes() + optimizer_->state_bytes();
}

template <class Optimizer>
size_t Offloaded<Optimizer>::device_bytes() const {
  // The check's scratch (GradientCheckPlan: a double and a flag per chunk)
  // is a workspace, not state; counted so that what the GPU holds is told in full.
  const size_t scratch = check_ ? check_->plan().chunks().size() * (sizeof(double) + sizeof(bool)) + 1 : 0;
  return scalars_device_.bytes() + (scaler_ ? sizeof(LossScalerState) : 0) + scratch;
}

// The class (its members in offloaded_step.cc and offloaded_state.cc are
// instantiated there).
template class Offloaded<Adam>;
template class Offloaded<Lamb>;

}  // namespace gradkit
