#include "gradkit/comm/gradient_arena.h"

#include <algorithm>
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

ShardedLayout ShardedLayout::make(std::span<const int64_t> numels, int world_size, int64_t bucket_elements,
                                  int64_t alignment) {
  constexpr std::string_view op = "ShardedLayout::make";
  if (world_size < 1) {
    throw_argument_error(ErrorCode::invalid_argument, op, "world_size", "is " + std::to_string(world_size) + ", expected >= 1");
  }
  if (bucket_elements < 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "bucket_elements",
                         "is " + std::to_string(bucket_elements) + ", expected >= 0 (0: one bucket)");
  }
  if (alignment < 1 || alignment > 4096 || (alignment & (alignment - 1)) != 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "alignment",
                         "is " + std::to_string(alignment) + ", expected a power of two from 1 to 4096");
  }
  ShardedLayout layout;
  layout.world_size = world_size;
  layout.alignment = alignment;
  layout.numels.assign(numels.begin(), numels.end());
  layout.offsets.resize(numels.size());
  const int64_t unit = alignment * world_size;  // a bucket's span is a multiple of this
  constexpr int64_t kMaxElements = int64_t{1} << 58;  // keeps every sum below 2^62 bytes for 16-byte types
  int64_t end = 0;  // end of the last tensor placed
  int64_t in_bucket = 0;
  auto close_bucket = [&] {
    ShardedLayout::Bucket& b = layout.buckets.back();
    const int64_t span = (end - b.begin + unit - 1) / unit * unit;
    b.slice = span / world_size;
    end = b.begin + span;
  };
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0 || numels[i] > kMaxElements - end - 2 * unit) {
      throw_argument_error(ErrorCode::invalid_argument, op, "numels[" + std::to_string(i) + "]",
                           "is " + std::to_string(numels[i]) + ", expected a count >= 0 that keeps the layout below 2^58 elements");
    }
    const bool new_bucket = layout.buckets.empty() ||
                            (bucket_elements > 0 && in_bucket > 0 && in_bucket + numels[i] > bucket_elements);
    if (new_bucket) {
      if (!layout.buckets.empty()) close_bucket();
      layout.buckets.push_back({i, i, end, 0});
      in_bucket = 0;
    }
    layout.offsets[i] = (end + alignment - 1) / alignment * alignment;
    end = layout.offsets[i] + numels[i];
    in_bucket += numels[i];
    layout.buckets.back().last = i + 1;
  }
  if (!layout.buckets.empty()) close_bucket();
  layout.total = end;
  return layout;
}

void ShardedLayout::validate(std::string_view op) const {
  auto refuse = [&](const std::string& field, const std::string& what) {
    throw_argument_error(ErrorCode::invalid_argument, op, "layout." + field, what);
  };
  if (world_size < 1) refuse("world_size", "is " + std::to_string(world_size) + ", expected >= 1");
  if (alignment < 1 || (alignment & (alignment - 1)) != 0) {
    refuse("alignment", "is " + std::to_string(alignment) + ", expected a power of two");
  }
  if (offsets.size() != numels.size()) {
    refuse("offsets", "has " + std::to_string(offsets.size()) + " entries, expected one per count (" +
                          std::to_string(numels.size()) + ")");
  }
  int64_t end = 0;       // of the last bucket
  size_t tensor = 0;     // the next tensor a bucket must start with
  for (size_t b = 0; b < buckets.size(); ++b) {
    const Bucket& k = buckets[b];
    const std::string name = "buckets[" + std::to_string(b) + "]";
    if (k.first != tensor || k.last < k.first || k.last > numels.size()) {
      refuse(name, "holds tensors [" + std::to_string(k.first) + ", " + std::to_string(k.last) + "), expected to start at " +
                       std::to_string(tensor) + " and end by " + std::to_string(numels.size()));
    }
    if (k.begin != end || k.slice < 0) {
      refuse(name, "begins at " + std::to_string(k.begin) + " with slices of " + std::to_string(k.slice) +
                       ", expected to begin at " + std::to_string(end) + " with slices >= 0");
    }
    const int64_t bucket_end = k.begin + k.slice * world_size;
    for (size_t t = k.first; t < k.last; ++t) {
      if (numels[t] < 0 || offsets[t] < k.begin || offsets[t] > bucket_end - numels[t] ||
          (t > k.first && offsets[t] < offsets[t - 1] + numels[t - 1])) {
        refuse("offsets[" + std::to_string(t) + "]", "is " + std::to_string(offsets[t]) + " for " +
                                                          std::to_string(numels[t]) +
                                                          " elements, expected them inside bucket " + std::to_string(b) +
                                                          " after the previous tensor");
      }
    }
    tensor = k.last;
    end = bucket_end;
  }
  if (tensor != numels.size()) refuse("buckets", "cover " + std::to_string(tensor) + " of the " + std::to_string(numels.size()) + " tensors");
  if (total != end) refuse("total", "is " + std::to_string(total) + ", expected " + std::to_string(end) + " (the buckets' end)");
}

int64_t ShardedLayout::shard_elements() const {
  int64_t n = 0;
  for (const Bucket& b : buckets) n += b.slice;
  return n;
}

std::vector<ShardedLayout::Piece> ShardedLayout::pieces(int rank) const {
  std::vector<Piece> out;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const int64_t lo = slice_begin(b, rank), hi = lo + buckets[b].slice;
    for (size_t t = buckets[b].first; t < buckets[b].last; ++t) {
      const int64_t begin = std::max(lo, offsets[t]), end = std::min(hi, offsets[t] + numels[t]);
      if (begin < end) out.push_back({t, b, begin - offsets[t], end - begin, begin - lo});
    }
  }
  return out;
}

GradientArena::GradientArena(Device device, DType dtype, const ShardedLayout& layout) : dtype_(dtype) {
  layout.validate("GradientArena");
  const size_t element = dtype_size(dtype);
  buffer_ = Buffer(device, static_cast<size_t>(layout.total) * element);
  views_.reserve(layout.numels.size());
  for (size_t i = 0; i < layout.numels.size(); ++i) {
    views_.push_back(buffer_.view(dtype, static_cast<size_t>(layout.offsets[i]) * element, layout.numels[i]));
  }
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
  size_t first = 0, bytes = 0;
  for (size_t i = 0; i < arena.size(); ++i) {
    if (i > first && bytes > 0 && bytes + arena[i].bytes() > bucket_bytes) {
      buckets_.add_bucket(first, i);
      first = i;
      bytes = 0;
    }
    bytes += arena[i].bytes();
  }
  if (arena.size() > 0) buckets_.add_bucket(first, arena.size());
}

TensorView BucketedAllReduce::bucket(size_t b) const {
  return arena_.range(buckets_.first(b), buckets_.last(b));
}

void BucketedAllReduce::start(size_t b, Stream compute_stream) {
  const TensorView range = bucket(b);
  if (comm_.device().is_cuda()) comm::stream_wait(comm_.device(), communication_stream_, compute_stream);
  comm_.all_reduce_buffer(range, range, op_, communication_stream_);
  buckets_.set_started(b);
}

void BucketedAllReduce::mark_ready(size_t gradient, Stream compute_stream) {
  if (const auto completed = buckets_.mark("BucketedAllReduce::mark_ready", gradient)) start(*completed, compute_stream);
}

void BucketedAllReduce::finish(Stream compute_stream) {
  for (size_t b = 0; b < buckets_.num_buckets(); ++b) {
    if (!buckets_.started(b)) start(b, compute_stream);
  }
  if (comm_.device().is_cuda()) comm::stream_wait(comm_.device(), compute_stream, communication_stream_);
  buckets_.reset();
}

namespace detail {

void BucketReadiness::add_bucket(size_t first, size_t last) {
  buckets_.push_back({first, last, last - first, false});
  bucket_of_.resize(last, buckets_.size() - 1);
  ready_.resize(last, false);
}

std::optional<size_t> BucketReadiness::mark(std::string_view op, size_t gradient) {
  if (gradient >= ready_.size() || ready_[gradient]) {
    throw_argument_error(ErrorCode::invalid_argument, op, "gradient",
                         "is " + std::to_string(gradient) +
                             (gradient >= ready_.size() ? ", expected an index below " + std::to_string(ready_.size())
                                                        : ", already marked ready in this step"));
  }
  ready_[gradient] = true;
  const size_t b = bucket_of_[gradient];
  if (--buckets_[b].pending == 0) return b;
  return std::nullopt;
}

void BucketReadiness::reset() {
  for (Bucket& b : buckets_) {
    b.pending = b.last - b.first;
    b.started = false;
  }
  ready_.assign(ready_.size(), false);
}

}  // namespace detail

}  // namespace gradkit
