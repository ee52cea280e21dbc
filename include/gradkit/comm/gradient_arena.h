// A model's gradients as views into one allocation, so that all-reducing them
// is one collective over one range, and the optimizer's multi-tensor plans
// take the same views; and bucketed all-reduce, which starts reducing the
// gradients that are final while later ones are still being produced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "gradkit/comm/communicator.h"
#include "gradkit/comm/detail/bucket_readiness.h"
#include "gradkit/core/memory.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

// Where each tensor of a sharded model lies in its flat buffers (the
// gradients', the weights'), and which part of them each rank owns: the
// tensors in order, each starting on a multiple of `alignment` elements,
// grouped into buckets of consecutive tensors; each bucket padded so that
// it splits into world_size equal slices, and rank r owns slice r of every
// bucket. A bucket is the unit of one reduce-scatter and one all-gather
// (in place, no copies); a rank's shard is its slices of all buckets.
// Element offsets, so that one layout serves buffers of every dtype.
struct ShardedLayout {
  struct Bucket {
    size_t first = 0;   // tensors [first, last)
    size_t last = 0;
    int64_t begin = 0;  // first element of the bucket in the flat buffer
    int64_t slice = 0;  // elements per rank: the bucket spans world_size * slice
  };
  // A part of one tensor inside one rank's slice of one bucket.
  struct Piece {
    size_t tensor = 0;
    size_t bucket = 0;
    int64_t offset = 0;  // first element of the piece within its tensor
    int64_t count = 0;
    int64_t in_slice = 0;  // first element of the piece within the rank's slice of its bucket
  };

  int world_size = 1;
  int64_t alignment = 64;
  std::vector<int64_t> numels;
  std::vector<int64_t> offsets;  // of each tensor in the flat buffer
  std::vector<Bucket> buckets;
  int64_t total = 0;             // elements of the flat buffer, padding included

  // Buckets take consecutive tensors up to about `bucket_elements` (a larger
  // tensor is a bucket alone; 0 puts every tensor in one bucket). Each slice
  // is a multiple of `alignment` elements, so every piece starts aligned.
  // Throws invalid_argument naming the argument for a negative count, a
  // world_size < 1, a negative bucket size or an alignment that is not a
  // power of two from 1 to 4096.
  static ShardedLayout make(std::span<const int64_t> numels, int world_size, int64_t bucket_elements = 0,
                            int64_t alignment = 64);

  // Throws invalid_argument naming `op` and the field ("layout.offsets[3]")
  // unless the fields hold together as make() leaves them: one offset per
  // count, tensors in order inside their buckets, buckets back to back from
  // 0 and covering every tensor, total their end. For a layout built or
  // edited by hand; every user of a layout calls it.
  void validate(std::string_view op) const;

  int64_t slice_begin(size_t bucket, int rank) const { return buckets[bucket].begin + rank * buckets[bucket].slice; }
  // Elements rank `rank` owns, padding included: the sum of its slices.
  int64_t shard_elements() const;
  // The pieces of tensors in rank `rank`'s slices, in flat order (bucket by
  // bucket, tensor by tensor); gaps and padding belong to no piece.
  std::vector<Piece> pieces(int rank) const;
};

class GradientArena {
 public:
  // One zero-filled gradient of numels[i] elements of `dtype` per entry, on
  // `device`, in one Buffer (which starts on a 256-byte boundary). Each
  // gradient starts on an `alignment`-byte boundary: 256 (the default) suits
  // vectorized kernels; dtype_size(dtype) puts them back to back, so that a
  // Communicator's list all_reduce(gradients()) also takes its contiguous
  // path. The gaps alignment leaves are part of the arena and stay zero.
  GradientArena(Device device, DType dtype, std::span<const int64_t> numels, size_t alignment = 256);
  // The tensors of `layout` at its offsets, in one zero-filled Buffer of
  // layout.total elements (padding included): the gradients, or the
  // weights, of a sharded optimizer.
  GradientArena(Device device, DType dtype, const ShardedLayout& layout);

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

  size_t num_buckets() const { return buckets_.num_buckets(); }
  size_t bucket_of(size_t gradient) const { return buckets_.bucket_of(gradient); }
  TensorView bucket(size_t b) const;

  // Gradient `gradient` is final once the work queued so far on
  // `compute_stream` has run. Marking one twice in a step is an error.
  void mark_ready(size_t gradient, Stream compute_stream = {});
  // Starts the buckets not started yet (in bucket order), makes
  // `compute_stream` wait for every bucket's collective, and resets for the
  // next step.
  void finish(Stream compute_stream = {});

 private:
  void start(size_t bucket, Stream compute_stream);

  const GradientArena& arena_;
  Communicator& comm_;
  ReduceOp op_;
  Stream communication_stream_;
  detail::BucketReadiness buckets_;
};

}  // namespace gradkit
