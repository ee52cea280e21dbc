// OffloadedAdam's step: the buckets' copies on the lanes, their CPU steps
// on the host worker, the gradient check before them when there is one.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "backend/cuda_runtime.h"
#include "gradkit/core/error.h"
#include "optim/offloaded_parts.h"

namespace gradkit {

using detail::OffloadLanes;

void OffloadedAdam::bucket_ready(int bucket, Stream stream, std::span<const TensorView> grads) {
  const std::span<const size_t> tensors = bucket_tensors(bucket);
  if (handed_[static_cast<size_t>(bucket)]) {
    throw_argument_error(ErrorCode::invalid_argument, kOffloadedOp, "bucket",
                         "is " + std::to_string(bucket) +
                             ", which was already handed in this step; expected each bucket once per step "
                             "(finish() ends a step)");
  }
  if (!grads.empty()) {
    if (grads.size() != tensors.size()) {
      throw_argument_error(ErrorCode::size_mismatch, kOffloadedOp, "grads",
                           "has " + std::to_string(grads.size()) + " tensors, expected " +
                               std::to_string(tensors.size()) + " (bucket " + std::to_string(bucket) + "'s)");
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      const TensorView& now = grads[i];
      const TensorView& was = grads_[tensors[i]];
      const std::string name = "grads[" + std::to_string(i) + "]";
      if (now.numel != was.numel || now.dtype != was.dtype || now.device != was.device) {
        throw_argument_error(ErrorCode::size_mismatch, kOffloadedOp, name,
                             "is " + std::to_string(now.numel) + " elements of " + std::string(dtype_name(now.dtype)) +
                                 " on " + to_string(now.device) + ", expected " + std::to_string(was.numel) + " of " +
                                 std::string(dtype_name(was.dtype)) + " on " + to_string(was.device));
      }
      if (now.data == nullptr && now.numel > 0) {
        throw_argument_error(ErrorCode::null_pointer, kOffloadedOp, name, "is a null pointer with elements");
      }
      backend::check_memory_location(kOffloadedOp, "grads", i, now);
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      grads_moved_ = grads_moved_ || grads_[tensors[i]].data != grads[i].data;
      grads_[tensors[i]] = grads[i];
    }
  }
  hand(bucket, stream);
}

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

void OffloadedAdam::hand(int bucket, Stream stream) {
  const Bucket& b = buckets_[static_cast<size_t>(bucket)];
  if (std::none_of(handed_.begin(), handed_.end(), [](bool h) { return h; })) {
    // The first hand of a step: the worker is idle (finish() waited for it), so
    // the times can be reset from this thread.
    step_began_ns_ = now_ns();
    times_ = {};
  }
  lanes_->wait_for(OffloadLanes::to_host, stream);
  for (int p : b.pieces) {
    for (const OffloadSlice& s : pieces_[static_cast<size_t>(p)].slices) {
      lanes_->copy(OffloadLanes::to_host, element(staged_grads_[s.tensor], s.offset), element(grads_[s.tensor], s.offset),
                   slice_bytes(grads_[s.tensor], s.count));
    }
    lanes_->record(OffloadLanes::to_host, p);
    if (!check_) post_update(p);  // no check to wait for: update as soon as the piece is there
  }
  handed_[static_cast<size_t>(bucket)] = true;
}

void OffloadedAdam::post_update(int piece) {
  worker_->post([this, piece] {
    const int64_t waiting = now_ns();
    lanes_->host_wait(piece);
    const auto* scalars = static_cast<const OffloadScalars*>(scalars_host_.data());
    AdamStepInputs in;
    in.step = *adam_->step_count_device() + 1;  // advanced by end of step, when not skipped
    in.lr_device = adam_->lr_device();
    if (check_) {
      lanes_->host_wait(scalars_slot(static_cast<int>(pieces_.size())));
      in.found_inf = &scalars->found_inf;  // a skipped step writes nothing
      in.grad_scale_device = &scalars->grad_divisor;
    }
    const int64_t updating = now_ns();
    times_.copy_wait_ms += static_cast<double>(updating - waiting) * 1e-6;
    const Piece& p = pieces_[static_cast<size_t>(piece)];
    p.plan.step(in);
    times_.update_ms += ms_since(updating);
    // A skipped step copies back the unchanged weights: the decision is
    // known only here, after the copy-backs of earlier pieces were queued.
    for (const OffloadSlice& s : p.slices) {
      const TensorView& from = low_precision_ ? staged_copies_[s.tensor] : masters_[s.tensor];
      lanes_->copy(OffloadLanes::to_device, element(params_[s.tensor], s.offset), element(from, s.offset),
                   slice_bytes(params_[s.tensor], s.count));
    }
  });
}

void OffloadedAdam::finish(Stream stream) {
  for (int b = 0; b < num_buckets(); ++b) {
    if (!handed_[static_cast<size_t>(b)]) hand(b, stream);
  }
  if (check_) {
    // The whole gradient is on the device now: check it there once, then
    // let the host steps read the decision and the divisor.
    if (grads_moved_) check_->set_grads(grads_, stream);
    grads_moved_ = false;
    auto* s = static_cast<OffloadScalars*>(scalars_device_.data());
    check_->check({&s->found_inf, &s->grad_divisor, &s->global_norm, nullptr}, 1.0f,
                  scaler_ ? scaler_->scale_device() : nullptr, stream);
    if (scaler_) scaler_->update(&s->found_inf, stream);
    lanes_->wait_for(OffloadLanes::to_host, stream);
    lanes_->copy(OffloadLanes::to_host, scalars_host_.data(), s, sizeof(OffloadScalars));
    lanes_->record(OffloadLanes::to_host, scalars_slot(static_cast<int>(pieces_.size())));
    for (int p = 0; p < static_cast<int>(pieces_.size()); ++p) post_update(p);
  }
  worker_->post([this] {
    const auto* scalars = static_cast<const OffloadScalars*>(scalars_host_.data());
    if (!check_ || !scalars->found_inf) ++*adam_->step_count_device();
    times_.span_ms = ms_since(step_began_ns_);
    last_times_ = times_;
  });
  handed_.assign(handed_.size(), false);
  try {
    worker_->wait();  // until the last copy-back is queued (not done)
  } catch (...) {
    lanes_->make_wait(stream, OffloadLanes::to_device);
    throw;
  }
  // The copy-backs were queued after their buckets' gradient copies had
  // completed, so waiting for them orders everything the step did.
  lanes_->make_wait(stream, OffloadLanes::to_device);
}

void OffloadedAdam::synchronize() {
  worker_->wait();
  lanes_->synchronize();
}

int64_t OffloadedAdam::step_count() {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return adam_->step_count();
}

void OffloadedAdam::set_step_count(int64_t steps) {
  if (steps < 0 || steps == std::numeric_limits<int64_t>::max()) {
    throw_argument_error(ErrorCode::invalid_argument, kOffloadedOp, "steps",
                         "is " + std::to_string(steps) + ", expected 0 to 2^63 - 2");
  }
  worker_->wait();
  *adam_->step_count_device() = steps;  // the host Adam's counter is host memory
}

float OffloadedAdam::lr(int group) {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return adam_->lr(group);
}

void OffloadedAdam::set_lr(int group, float lr) {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  adam_->set_lr(group, lr);
}

bool OffloadedAdam::last_step_skipped() {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return check_ && static_cast<const OffloadScalars*>(scalars_host_.data())->found_inf;
}

OffloadStepTimes OffloadedAdam::last_step_times() {
  worker_->wait();
  return last_times_;
}

float OffloadedAdam::last_grad_norm() {
  worker_->wait();  // the host state is the worker's until then; the GPU need not be idle
  return check_ ? static_cast<const OffloadScalars*>(scalars_host_.data())->global_norm
                : std::numeric_limits<float>::quiet_NaN();
}

}  // namespace gradkit
