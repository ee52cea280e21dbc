// Offloaded<Adam or Lamb>'s step: the buckets' copies on the lanes, their
// CPU steps on the host worker, the gradient check before them when there
// is one.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "spec/cuda_runtime.h"
#include "gradkit/core/error.h"
#include "optim/offloaded_parts.h"

namespace gradkit {

using detail::OffloadLanes;

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double ms_since(int64_t ns) { return static_cast<double>(now_ns() - ns) * 1e-6; }

// The address of element `offset` of `v`.
void* element(const TensorView& v, int64_t offset) {
  return static_cast<char*>(v.data) + static_cast<size_t>(offset) * dtype_size(v.dtype);
}

size_t slice_bytes(const TensorView& v, int64_t count) { return static_cast<size_t>(count) * dtype_size(v.dtype); }

}  // namespace

template <class Optimizer>
void Offloaded<Optimizer>::bucket_ready(int bucket, Stream stream, std::span<const TensorView> grads, bool complete) {
  const std::span<const size_t> tensors = bucket_tensors(bucket);
  const auto b = static_cast<size_t>(bucket);
  if (handed_[b] && complete_[b] && (options_.release || !checks_)) {
    throw_argument_error(ErrorCode::invalid_argument, OffloadTraits<Optimizer>::op, "bucket",
                         "is " + std::to_string(bucket) +
                             ", which was already handed complete in this step, and its update may have begun; "
                             "expected each bucket once per step (finish() ends a step)" +
                             (options_.release ? std::string{}
                                               : std::string{" (gradients replaced after they were handed need "
                                                             "the updates to wait for finish(): a scaler or max_norm)"}));
  }
  if (!grads.empty()) {
    if (grads.size() != tensors.size()) {
      throw_argument_error(ErrorCode::size_mismatch, OffloadTraits<Optimizer>::op, "grads",
                           "has " + std::to_string(grads.size()) + " tensors, expected " +
                               std::to_string(tensors.size()) + " (bucket " + std::to_string(bucket) + "'s)");
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      const TensorView& now = grads[i];
      const TensorView& was = grads_[tensors[i]];
      const std::string name = "grads[" + std::to_string(i) + "]";
      if (now.numel != was.numel || now.dtype != was.dtype || now.device != was.device) {
        throw_argument_error(ErrorCode::size_mismatch, OffloadTraits<Optimizer>::op, name,
                             "is " + std::to_string(now.numel) + " elements of " + std::string(dtype_name(now.dtype)) +
                                 " on " + to_string(now.device) + ", expected " + std::to_string(was.numel) + " of " +
                                 std::string(dtype_name(was.dtype)) + " on " + to_string(was.device));
      }
      if (now.data == nullptr && now.numel > 0) {
        throw_argument_error(ErrorCode::null_pointer, OffloadTraits<Optimizer>::op, name, "is a null pointer with elements");
      }
      spec::check_memory_location(OffloadTraits<Optimizer>::op, "grads", i, now);
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      grads_moved_ = grads_moved_ || grads_[tensors[i]].data != grads[i].data;
      grads_[tensors[i]] = grads[i];
    }
  }
  if (handed_[b] && options_.release) hand_again(bucket, stream);
  else hand(bucket, stream);  // the first hand, or (without release) one that replaces it
  if (complete && !complete_[b]) bucket_complete(bucket);
}

template <class Optimizer>
Stream Offloaded<Optimizer>::copy_stream() const {
  return lanes_->stream(OffloadLanes::to_host);
}

template <class Optimizer>
void Offloaded<Optimizer>::hand(int bucket, Stream stream) {
  const Bucket& b = buckets_[static_cast<size_t>(bucket)];
  const bool first = std::none_of(handed_.begin(), handed_.end(), [](bool h) { return h; });
  if (first) {
    // The first hand of a step: the worker is idle (finish() waited for it), so
    // the times can be reset from this thread.
    step_began_ns_ = now_ns();
    times_ = {};
  }
  lanes_->wait_for(OffloadLanes::to_host, stream);
  if (first && options_.release && scaler_) {
    // The host check unscales by this step's S, which the scaler wrote in the last step's finish().
    auto* host = static_cast<OffloadScalars*>(scalars_host_.data());
    lanes_->copy(OffloadLanes::to_host, &host->loss_scale, scaler_->scale_device(), sizeof(float));
    lanes_->record(OffloadLanes::to_host, scalars_slot(static_cast<int>(pieces_.size())));
  }
  for (int p : b.pieces) {
    for (const OffloadSlice& s : pieces_[static_cast<size_t>(p)].slices) {
      lanes_->copy(OffloadLanes::to_host, element(staged_grads_[s.tensor], s.offset), element(grads_[s.tensor], s.offset),
                   slice_bytes(grads_[s.tensor], s.count));
    }
    lanes_->record(OffloadLanes::to_host, p);
  }
  handed_[static_cast<size_t>(bucket)] = true;
}

template <class Optimizer>
void Offloaded<Optimizer>::hand_again(int bucket, Stream stream) {
  const size_t landings = std::min<size_t>(kLandings, pieces_.size());
  lanes_->wait_for(OffloadLanes::to_host, stream);
  for (int p : buckets_[static_cast<size_t>(bucket)].pieces) {
    const auto piece = static_cast<size_t>(p);
    std::atomic<bool>& busy = landing_busy_[piece % landings];
    // The worker is a few pieces behind and still adds from this landing:
    // let it catch up (this rethrows its error, if it had one).
    if (busy.load(std::memory_order_acquire)) worker_->wait();
    busy.store(true, std::memory_order_relaxed);
    const std::vector<OffloadSlice>& slices = pieces_[piece].slices;
    for (size_t j = 0; j < slices.size(); ++j) {
      const OffloadSlice& s = slices[j];
      lanes_->copy(OffloadLanes::to_host, piece_landing_[piece][j].data, element(grads_[s.tensor], s.offset),
                   slice_bytes(grads_[s.tensor], s.count));
    }
    lanes_->record(OffloadLanes::to_host, p);
    worker_->post([this, p, &busy] {
      lanes_->host_wait(p);  // this hand's copies, and so the earlier ones into the staging
      piece_adds_[static_cast<size_t>(p)].accumulate();
      busy.store(false, std::memory_order_release);
    });
  }
}

template <class Optimizer>
void Offloaded<Optimizer>::bucket_complete(int bucket) {
  complete_[static_cast<size_t>(bucket)] = true;
  for (int p : buckets_[static_cast<size_t>(bucket)].pieces) {
    if (!checks_) post_update(p);  // no check to wait for: update as soon as the piece is there
    else if (options_.release) post_host_check(p);
  }
}

template <class Optimizer>
void Offloaded<Optimizer>::post_host_check(int piece) {
  piece_checked_[static_cast<size_t>(piece)] = true;
  worker_->post([this, piece] {
    lanes_->host_wait(piece);  // its last copy; the adds from the landings ran before this task
    const float* scale = nullptr;
    if (scaler_) {
      lanes_->host_wait(scalars_slot(static_cast<int>(pieces_.size())));
      scale = &static_cast<const OffloadScalars*>(scalars_host_.data())->loss_scale;
    }
    GradientCheckOutputs out;
    out.partial = &piece_partials_[2 * static_cast<size_t>(piece)];
    piece_checks_[static_cast<size_t>(piece)].check(out, 1.0f, scale);
  });
}

template <class Optimizer>
void Offloaded<Optimizer>::finish_host_check() {
  for (size_t p = 0; p < pieces_.size(); ++p) {
    if (!piece_checked_[p]) post_host_check(static_cast<int>(p));
  }
  auto* device = static_cast<OffloadScalars*>(scalars_device_.data());
  worker_->post([this, device] {
    auto* host = static_cast<OffloadScalars*>(scalars_host_.data());
    GradientCheckOutputs out;
    out.found_inf = &host->found_inf;
    out.grad_divisor = &host->grad_divisor;
    out.global_norm = &host->global_norm;
    piece_checks_[0].combine(piece_partials_.data(), static_cast<int>(pieces_.size()), out, 1.0f,
                             scaler_ ? &host->loss_scale : nullptr);
    // The scaler on the device decides from found_inf after finish() (before the copy-backs, in lane order).
    if (scaler_) lanes_->copy(OffloadLanes::to_device, device, host, sizeof(OffloadScalars));
  });
  piece_checked_.assign(piece_checked_.size(), false);
}

template <class Optimizer>
void Offloaded<Optimizer>::post_update(int piece) {
  worker_->post([this, piece] {
    const int64_t waiting = now_ns();
    lanes_->host_wait(piece);
    const OffloadScalars* scalars = nullptr;
    if (checks_) {
      lanes_->host_wait(scalars_slot(static_cast<int>(pieces_.size())));
      scalars = static_cast<const OffloadScalars*>(scalars_host_.data());
    }
    const int64_t updating = now_ns();
    times_.copy_wait_ms += static_cast<double>(updating - waiting) * 1e-6;
    const Piece& p = pieces_[static_cast<size_t>(piece)];
    OffloadTraits<Optimizer>::step(p.plan, *optimizer_, scalars);
    times_.update_ms += ms_since(updating);
    // A skipped step wrote nothing, so nothing is copied back (the model
    // copy's staging may hold the gradients: the constructor).
    if (scalars != nullptr && scalars->found_inf) return;
    for (const OffloadSlice& s : p.slices) {
      const TensorView& from = low_precision_ ? staged_copies_[s.tensor] : masters_[s.tensor];
      lanes_->copy(OffloadLanes::to_device, element(params_[s.tensor], s.offset), element(from, s.offset),
                   slice_bytes(params_[s.tensor], s.count));
    }
  });
}

template <class Optimizer>
void Offloaded<Optimizer>::finish(Stream stream) {
  if (options_.release) {
    for (int b = 0; b < num_buckets(); ++b) {
      if (!handed_[static_cast<size_t>(b)]) {
        throw_argument_error(ErrorCode::invalid_argument, OffloadTraits<Optimizer>::op, "bucket",
                             std::to_string(b) + " was not handed in this step; expected every bucket handed before "
                             "finish() with release (its gradients may be gone from the device)");
      }
    }
  }
  for (int b = 0; b < num_buckets(); ++b) {
    if (!handed_[static_cast<size_t>(b)]) hand(b, stream);
    if (!complete_[static_cast<size_t>(b)]) bucket_complete(b);
  }
  auto* s = static_cast<OffloadScalars*>(scalars_device_.data());
  if (checks_) {
    if (options_.release) {
      finish_host_check();
    } else {
      // The whole gradient is on the device now: check it there once, then
      // let the host steps read the decision and the divisor.
      if (grads_moved_) check_->set_grads(grads_, stream);
      grads_moved_ = false;
      check_->check({&s->found_inf, &s->grad_divisor, &s->global_norm, nullptr}, 1.0f,
                    scaler_ ? scaler_->scale_device() : nullptr, stream);
      if (scaler_) scaler_->update(&s->found_inf, stream);
      lanes_->wait_for(OffloadLanes::to_host, stream);
      lanes_->copy(OffloadLanes::to_host, scalars_host_.data(), s, sizeof(OffloadScalars));
      lanes_->record(OffloadLanes::to_host, scalars_slot(static_cast<int>(pieces_.size())));
    }
    for (int p = 0; p < static_cast<int>(pieces_.size()); ++p) post_update(p);
  }
  worker_->post([this] {
    const auto* scalars = static_cast<const OffloadScalars*>(scalars_host_.data());
    if (!checks_ || !scalars->found_inf) ++*OffloadTraits<Optimizer>::counter(*optimizer_);
    times_.span_ms = ms_since(step_began_ns_);
    last_times_ = times_;
  });
  handed_.assign(handed_.size(), false);
  complete_.assign(complete_.size(), false);
  try {
    worker_->wait();  // until the last copy-back is queued (not done)
  } catch (...) {
    lanes_->make_wait(stream, OffloadLanes::to_device);
    throw;
  }
  // The copy-backs were queued after their buckets' gradient copies had
  // completed, so waiting for them orders everything the step did.
  lanes_->make_wait(stream, OffloadLanes::to_device);
  // With release the decision was made on the host; found_inf reached the
  // device on the copy-back lane, which `stream` now waits for.
  if (options_.release && scaler_) scaler_->update(&s->found_inf, stream);
}

template <class Optimizer>
void Offloaded<Optimizer>::synchronize() {
  worker_->wait();
  lanes_->synchronize();
}

template <class Optimizer>
int64_t Offloaded<Optimizer>::step_count() {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return optimizer_->step_count();
}

template <class Optimizer>
void Offloaded<Optimizer>::set_step_count(int64_t steps) {
  // The counter after `steps` steps must still count the next one.
  constexpr int64_t offset = OffloadTraits<Optimizer>::counter_offset;
  constexpr int64_t largest = std::numeric_limits<int64_t>::max() - 1 - offset;
  if (steps < 0 || steps > largest) {
    throw_argument_error(ErrorCode::invalid_argument, OffloadTraits<Optimizer>::op, "steps",
                         "is " + std::to_string(steps) + ", expected 0 to " + std::to_string(largest));
  }
  worker_->wait();
  *OffloadTraits<Optimizer>::counter(*optimizer_) = steps + offset;  // host memory
}

template <class Optimizer>
float Offloaded<Optimizer>::lr(int group)
  requires std::same_as<Optimizer, Adam>
{
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return optimizer_->lr(group);
}

template <class Optimizer>
void Offloaded<Optimizer>::set_lr(int group, float lr)
  requires std::same_as<Optimizer, Adam>
{
  check_value(lr >= 0 && lr < INFINITY, OffloadTraits<Optimizer>::op, "lr", lr, "a finite value >= 0");
  worker_->wait();
  optimizer_->set_lr(group, lr);
}

template <class Optimizer>
float Offloaded<Optimizer>::eta()
  requires std::same_as<Optimizer, Lamb>
{
  worker_->wait();
  return optimizer_->eta();
}

template <class Optimizer>
void Offloaded<Optimizer>::set_eta(float eta)
  requires std::same_as<Optimizer, Lamb>
{
  validate_eta(eta, OffloadTraits<Optimizer>::op, "eta");
  worker_->wait();
  optimizer_->set_eta(eta);
}

template <class Optimizer>
bool Offloaded<Optimizer>::last_step_skipped() {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return checks_ && static_cast<const OffloadScalars*>(scalars_host_.data())->found_inf;
}

template <class Optimizer>
OffloadStepTimes Offloaded<Optimizer>::last_step_times() {
  worker_->wait();
  return last_times_;
}

template <class Optimizer>
float Offloaded<Optimizer>::last_grad_norm() {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return checks_ ? static_cast<const OffloadScalars*>(scalars_host_.data())->global_norm
                : std::numeric_limits<float>::quiet_NaN();
}

// This file's members of both (offloaded.cc instantiates the class).
template void Offloaded<Adam>::bucket_ready(int, Stream, std::span<const TensorView>, bool);
template void Offloaded<Lamb>::bucket_ready(int, Stream, std::span<const TensorView>, bool);
template Stream Offloaded<Adam>::copy_stream() const;
template Stream Offloaded<Lamb>::copy_stream() const;
template void Offloaded<Adam>::finish(Stream);
template void Offloaded<Lamb>::finish(Stream);
template void Offloaded<Adam>::synchronize();
template void Offloaded<Lamb>::synchronize();
template int64_t Offloaded<Adam>::step_count();
template int64_t Offloaded<Lamb>::step_count();
template void Offloaded<Adam>::set_step_count(int64_t);
template void Offloaded<Lamb>::set_step_count(int64_t);
template float Offloaded<Adam>::lr(int);
template void Offloaded<Adam>::set_lr(int, float);
template float Offloaded<Lamb>::eta();
template void Offloaded<Lamb>::set_eta(float);
template bool Offloaded<Adam>::last_step_skipped();
template bool Offloaded<Lamb>::last_step_skipped();
template OffloadStepTimes Offloaded<Adam>::last_step_times();
template OffloadStepTimes Offloaded<Lamb>::last_step_times();
template float Offloaded<Adam>::last_grad_norm();
template float Offloaded<Lamb>::last_grad_norm();

}  // namespace gradkit
