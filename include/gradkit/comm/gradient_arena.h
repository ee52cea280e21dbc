// A model's gradients as views into one allocation, so that all-reducing them
// is one collective over one range, and the optimizer's multi-tensor plans
// take the same views; and bucketed all-reduce, which starts reducing the
// gradients that are final while later ones are still being produced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "gradkit/comm/communicator.h"
#include "gradkit/core/memory.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

class GradientArena {
 public:
  // One zero-filled gradient of numels[i] elements of `dtype` per entry, on
  // `device`, in one Buffer (which starts on a 256-byte boundary). Each
  // gradient starts on an `alignment`-byte boundary: 256 (the default) suits
  // vectorized kernels; dtype_size(dtype) puts them back to back, so that a
  // Communicator's list all_reduce(gradients()) also takes its contiguous
  // path. The gaps alignment leaves are part of the arena and stay zero.
  GradientArena(Device device, DType dtype, std::span<const int64_t> numels, size_t alignment = 256);

  size_t size() const { return views_.size(); }
  const TensorView& operator[](size_t i) const { return views_[i]; }
  std::span<const TensorView> gradients() const { return views_; }
  DType dtype() const { return dtype_; }
  Device device() const { return buffer_.device(); }
  const Buffer& buffer() const { return buffer_; }

  // Elements from the start of gradient `first` to the end of gradient
  // `last` - 1, gaps included: what one collective covers.
  TensorView range(size_t first, size_t last) const;
  TensorView flat() const { return range(0, size()); }

  // Every gradient becomes the sum (or average) over the ranks of `comm`:
  // one collective over flat(), in place, on `stream`.
  void all_reduce(Communicator& comm, ReduceOp op = ReduceOp::sum, Stream stream = {}) const;

 private:
  Buffer buffer_;
  DType dtype_;
  std::vector<TensorView> views_;
};

// All-reduce of an arena in buckets of about `bucket_bytes` (consecutive
// gradients; one larger than that is a bucket alone), each started as soon as
// all of its gradients are marked ready. On CUDA the bucket's collective runs
// on `communication_stream`, after the work the compute stream had queued
// when the last gradient was marked (a CUDA event orders them), so it
// overlaps the compute stream's later work. With MPI the collective runs when
// the bucket completes, on the calling thread.
//
// Every rank must mark the gradients in the same order (the same model code
// does), since buckets are reduced in the order they complete; checked mode
// compares each bucket's shape across ranks.
class BucketedAllReduce {
 public:
  BucketedAllReduce(const GradientArena& arena, Communicator& comm, size_t bucket_bytes,
                    ReduceOp op = ReduceOp::sum, Stream communication_stream = {});

  size_t num_buckets() const { return buckets_.size(); }
  size_t bucket_of(size_t gradient) const { return bucket_of_.at(gradient); }
  TensorView bucket(size_t b) const;

  // Gradient `gradient` is final once the work queued so far on
  // `compute_stream` has run. Marking one twice in a step is an error.
  void mark_ready(size_t gradient, Stream compute_stream = {});
  // Starts the buckets not started yet (in bucket order), makes
  // `compute_stream` wait for every bucket's collective, and resets for the
  // next step.
  void finish(Stream compute_stream = {});

 private:
  struct Bucket {
    size_t first = 0;  // gradients [first, last)
    size_t last = 0;
    size_t pending = 0;  // gradients not marked yet this step
    bool started = false;
  };
  void start(Bucket& b, Stream compute_stream);

  const GradientArena& arena_;
  Communicator& comm_;
  ReduceOp op_;
  Stream communication_stream_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<bool> ready_;
};

}  // namespace gradkit
