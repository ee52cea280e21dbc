#include "gradkit/comm/gradient_arena.h"

#include <string>

#include "comm/stream_order.h"
#include "gradkit/core/error.h"

namespace gradkit {

namespace {

size_t round_up(size_t bytes, size_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

}  // namespace

GradientArena::GradientArena(Device device, DType dtype, std::span<const int64_t> numels, size_t alignment)
    : dtype_(dtype) {
  constexpr std::string_view op = "GradientArena";
  const size_t element = dtype_size(dtype);
  if (alignment < element || alignment > 256 || (alignment & (alignment - 1)) != 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "alignment",
                         "is " + std::to_string(alignment) + ", expected a power of two from dtype_size (" +
                             std::to_string(element) + ") to 256");
  }
  std::vector<size_t> offsets(numels.size());
  size_t end = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    // The running total stays below 2^62 bytes, so nothing here can wrap.
    constexpr size_t kMaxBytes = size_t{1} << 62;
    if (numels[i] < 0 || static_cast<size_t>(numels[i]) > (kMaxBytes - round_up(end, alignment)) / element) {
      throw_argument_error(ErrorCode::invalid_argument, op, "numels[" + std::to_string(i) + "]",
                           "is " + std::to_string(numels[i]) + ", expected a count >= 0 that keeps the arena below 2^62 bytes");
    }
    offsets[i] = round_up(end, alignment);
    end = offsets[i] + static_cast<size_t>(numels[i]) * element;
  }
  buffer_ = Buffer(device, end);
  views_.reserve(numels.size());
  for (size_t i = 0; i < numels.size(); ++i) views_.push_back(buffer_.view(dtype, offsets[i], numels[i]));
}

TensorView GradientArena::range(size_t first, size_t last) const {
  if (first > last || last > views_.size()) {
    throw_argument_error(ErrorCode::invalid_argument, "GradientArena::range", "last",
                         "is " + std::to_string(last) + " with first " + std::to_string(first) +
                             ", expected first <= last <= " + std::to_string(views_.size()));
  }
  if (first == last) return TensorView{buffer_.data(), 0, dtype_, device()};
  auto* begin = static_cast<unsigned char*>(views_[first].data);
  const auto* end = static_cast<unsigned char*>(views_[last - 1].data) + views_[last - 1].bytes();
  return TensorView{begin, static_cast<int64_t>((end - begin) / dtype_size(dtype_)), dtype_, device()};
}

void GradientArena::all_reduce(Communicator& comm, ReduceOp op, Stream stream) const {
  const TensorView all = flat();
  comm.all_reduce_buffer(all, all, op, stream);
}

BucketedAllReduce::BucketedAllReduce(const GradientArena& arena, Communicator& comm, size_t bucket_bytes,
                                     ReduceOp op, Stream communication_stream)
    : arena_(arena), comm_(comm), op_(op), communication_stream_(communication_stream) {
  constexpr std::string_view name = "BucketedAllReduce";
  if (arena.device() != comm.device()) {
    throw_argument_error(ErrorCode::device_mismatch, name, "arena",
                         "is on " + to_string(arena.device()) + ", expected " + to_string(comm.device()) +
                             " (the communicator's device)");
  }
  if (bucket_bytes == 0) {
    throw_argument_error(ErrorCode::invalid_argument, name, "bucket_bytes", "is 0, expected > 0");
  }
  bucket_of_.resize(arena.size());
  ready_.assign(arena.size(), false);
  size_t bytes = 0;
  for (size_t i = 0; i < arena.size(); ++i) {
    if (buckets_.empty() || (bytes > 0 && bytes + arena[i].bytes() > bucket_bytes)) {
      buckets_.push_back({i, i, 0, false});
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    b.last = i + 1;
    ++b.pending;
    bytes += arena[i].bytes();
    bucket_of_[i] = buckets_.size() - 1;
  }
}

TensorView BucketedAllReduce::bucket(size_t b) const {
  const Bucket& bucket = buckets_.at(b);
  return arena_.range(bucket.first, bucket.last);
}

void BucketedAllReduce::start(Bucket& b, Stream compute_stream) {
  const TensorView range = arena_.range(b.first, b.last);
  if (comm_.device().is_cuda()) comm::stream_wait(comm_.device(), communication_stream_, compute_stream);
  comm_.all_reduce_buffer(range, range, op_, communication_stream_);
  b.started = true;
}

void BucketedAllReduce::mark_ready(size_t gradient, Stream compute_stream) {
  if (gradient >= ready_.size() || ready_[gradient]) {
    throw_argument_error(ErrorCode::invalid_argument, "BucketedAllReduce::mark_ready", "gradient",
                         "is " + std::to_string(gradient) +
                             (gradient >= ready_.size() ? ", expected an index below " + std::to_string(ready_.size())
                                                        : ", already marked ready in this step"));
  }
  ready_[gradient] = true;
  Bucket& b = buckets_[bucket_of_[gradient]];
  if (--b.pending == 0) start(b, compute_stream);
}

void BucketedAllReduce::finish(Stream compute_stream) {
  for (Bucket& b : buckets_) {
    if (!b.started) start(b, compute_stream);
  }
  if (comm_.device().is_cuda()) comm::stream_wait(comm_.device(), compute_stream, communication_stream_);
  for (Bucket& b : buckets_) {
    b.pending = b.last - b.first;
    b.started = false;
  }
  ready_.assign(ready_.size(), false);
}

}  // namespace gradkit
