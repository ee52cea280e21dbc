// The engine-independent half of every communicator: validation, checked
// mode, the contiguous path and the fusion-buffer path of the tensor-list
// collectives. The engines (MPI, NCCL) supply the flat primitives.
#include "gradkit/comm/communicator.h"

#include <cstring>
#include <string>
#include <vector>

#include "comm/fingerprint.h"
#include "comm/tensor_list.h"
#include "gradkit/core/error.h"

namespace gradkit {

using comm::CallKind;
using comm::ListInfo;

namespace {

unsigned char* at(unsigned char* base, int64_t elements, DType dtype) {
  return base + static_cast<size_t>(elements) * dtype_size(dtype);
}

}  // namespace

ShardLayout ShardLayout::of(int64_t total, DType dtype, int world_size) {
  // Each share a multiple of 32 bytes: the unit of padding is world_size
  // groups of 32 bytes' worth of elements.
  const int64_t unit = static_cast<int64_t>(32 / dtype_size(dtype)) * world_size;
  ShardLayout layout;
  layout.total = total;
  layout.padded_total = (total + unit - 1) / unit * unit;
  layout.shard = layout.padded_total / world_size;
  return layout;
}

Communicator::Communicator(int rank, int size, int local_rank, int local_size, Device device,
                           const CommunicatorOptions& options)
    : rank_(rank),
      size_(size),
      local_rank_(local_rank),
      local_size_(local_size),
      device_(device),
      checked_(options.checked),
      timeout_(options.timeout),
      fusion_pipeline_bytes_(options.fusion_pipeline_bytes),
      direct_tensor_bytes_(options.direct_tensor_bytes),
      list_checks_(std::make_unique<comm::ListCheckCache>()) {}

Communicator::~Communicator() = default;

void Communicator::require_usable(std::string_view op) const {
  if (!failure_.empty()) {
    throw Error(ErrorCode::invalid_argument,
                std::string(op) + ": the communicator is unusable after an earlier failure: " + failure_);
  }
}

unsigned char* Communicator::fusion_bytes(size_t bytes) {
  if (fusion_.bytes() < bytes) {
    // Grow-only, in whole MiB past the first MiB, so that a list that grows a
    // little from step to step does not reallocate each time.
    constexpr size_t kMiB = size_t{1} << 20;
    const size_t rounded = bytes <= kMiB ? bytes : (bytes + kMiB - 1) / kMiB * kMiB;
    fusion_ = Buffer();  // free the old one first: peak memory is the new size
    fusion_ = Buffer(device_, rounded);
  }
  return static_cast<unsigned char*>(fusion_.data());
}

void Communicator::pack(std::span<const TensorView> inputs, unsigned char* fusion, int64_t begin, int64_t end,
                        Stream stream) {
  comm::for_each_piece(inputs, begin, end, [&](const TensorView& t, int64_t in_tensor, int64_t flat, int64_t n) {
    copy(at(fusion, flat, t.dtype), at(static_cast<unsigned char*>(t.data), in_tensor, t.dtype),
         static_cast<size_t>(n) * dtype_size(t.dtype), stream);
  });
}

void Communicator::unpack(const unsigned char* fusion, std::span<const TensorView> outputs, int64_t begin,
                          int64_t end, Stream stream) {
  comm::for_each_piece(outputs, begin, end, [&](const TensorView& t, int64_t in_tensor, int64_t flat, int64_t n) {
    copy(at(static_cast<unsigned char*>(t.data), in_tensor, t.dtype), fusion + static_cast<size_t>(flat) * dtype_size(t.dtype),
         static_cast<size_t>(n) * dtype_size(t.dtype), stream);
  });
}

void Communicator::check_fingerprint(std::string_view op, int kind, ReduceOp reduce,
                                     std::span<const TensorView> tensors) {
  check_fingerprint(op, kind, static_cast<uint32_t>(reduce), tensors);
}

void Communicator::check_fingerprint(std::string_view op, int kind, uint32_t variant,
                                     std::span<const TensorView> tensors) {
  const uint32_t settings = static_cast<CallKind>(kind) == CallKind::all_reduce ? list_settings() : 0;
  const comm::Fingerprint mine = comm::fingerprint_of(static_cast<CallKind>(kind), variant, tensors, settings);
  std::vector<comm::Fingerprint> all(static_cast<size_t>(size_));
  host_all_gather(&mine, all.data(), sizeof(mine));
  const std::optional<comm::Mismatch> mismatch = comm::find_mismatch(all);
  if (!mismatch) return;
  std::string what = mismatch->what;
  ErrorCode code = ErrorCode::invalid_argument;
  if (mismatch->sizes) {
    // Every rank saw the same fingerprints, so every rank makes this second
    // exchange too: the element counts, padded to the longest list.
    code = ErrorCode::size_mismatch;
    const auto stride = static_cast<size_t>(all[0].count);
    std::vector<int64_t> counts(stride, -1);
    for (size_t i = 0; i < tensors.size() && i < stride; ++i) counts[i] = tensors[i].numel;
    std::vector<int64_t> all_counts(stride * static_cast<size_t>(size_));
    host_all_gather(counts.data(), all_counts.data(), stride * sizeof(int64_t));
    what = comm::describe_size_mismatch(all_counts, stride, mismatch->rank);
  }
  throw_argument_error(code, op, "tensors",
                       "differs between ranks: " + what + " (checked mode; every rank must pass the same list)");
}

// ---- all-reduce

void Communicator::all_reduce(std::span<const TensorView> tensors, ReduceOp op, Stream stream) {
  reduce_list("all_reduce", tensors, tensors, op, stream);
}

void Communicator::all_reduce(std::span<const TensorView> inputs, std::span<const TensorView> outputs, ReduceOp op,
                              Stream stream) {
  reduce_list("all_reduce", inputs, outputs, op, stream);
}

void Communicator::reduce_list(std::string_view op, std::span<const TensorView> inputs,
                               std::span<const TensorView> outputs, ReduceOp reduce, Stream stream) {
  require_usable(op);
  const auto [in, out] = list_checks_->inspect(op, inputs, outputs, device_);
  if (checked_) check_fingerprint(op, static_cast<int>(CallKind::all_reduce), reduce, inputs);
  if (in.total == 0) return;

  // A contiguous side is used where it lies; a scattered one goes through
  // the fusion buffer (the engine decides how, from the list's shape, and
  // brackets its use of the buffer with fusion_begin / fusion_end).
  list_all_reduce({inputs, outputs, in.contiguous ? in.base : nullptr, out.contiguous ? out.base : nullptr, in.total,
                   in.dtype, reduce},
                  stream);
}

void Communicator::list_all_reduce(const ListReduce& r, Stream stream) {
  const bool uses_fusion = r.source == nullptr || r.destination == nullptr;
  unsigned char* fusion = nullptr;
  if (uses_fusion) {
    fusion = fusion_bytes(static_cast<size_t>(r.total) * dtype_size(r.dtype));
    fusion_begin(stream);
  }
  const unsigned char* source = r.source;
  if (source == nullptr) {
    pack(r.inputs, fusion, 0, r.total, stream);
    source = fusion;
  }
  unsigned char* destination = r.destination != nullptr ? r.destination : fusion;
  do_all_reduce(source, destination, r.total, r.dtype, stream);
  if (r.reduce == ReduceOp::average) divide(destination, r.total, r.dtype, size_, stream);
  if (r.destination == nullptr) unpack(fusion, r.outputs, 0, r.total, stream);
  if (uses_fusion) fusion_end(stream);
}

// ---- all-gather

void Communicator::all_gather(std::span<const TensorView> tensors, Stream stream) {
  gather_list("all_gather", tensors, tensors, stream);
}

void Communicator::all_gather(std::span<const TensorView> inputs, std::span<const TensorView> outputs, Stream stream) {
  gather_list("all_gather", inputs, outputs, stream);
}

void Communicator::gather_list(std::string_view op, std::span<const TensorView> inputs,
                               std::span<const TensorView> outputs, Stream stream) {
  require_usable(op);
  const auto [in, out] = list_checks_->inspect(op, inputs, outputs, device_);
  if (checked_) check_fingerprint(op, static_cast<int>(CallKind::all_gather), ReduceOp::sum, inputs);
  if (in.total == 0) return;

  const DType dtype = in.dtype;
  const ShardLayout layout = ShardLayout::of(in.total, dtype, size_);
  const int64_t mine = layout.begin(rank_);
  if (in.contiguous && out.contiguous && layout.padded_total == layout.total) {
    // In place when in.base == out.base: the send range is then rank r's
    // slice of the receive range, as NCCL and MPI_IN_PLACE expect.
    do_all_gather(at(in.base, mine, dtype), out.base, layout.shard, dtype, stream);
    return;
  }
  unsigned char* fusion = fusion_bytes(static_cast<size_t>(layout.padded_total) * dtype_size(dtype));
  fusion_begin(stream);
  // This rank's slice goes to its place in the fusion buffer; its padding is
  // zeroed so that no uninitialized bytes travel.
  pack(inputs, fusion, mine, layout.end(rank_), stream);
  const int64_t padding_begin = std::max(layout.total, rank_ * layout.shard);
  const int64_t padding_end = (rank_ + 1) * layout.shard;
  if (padding_begin < padding_end) {
    fill_zero(at(fusion, padding_begin, dtype), static_cast<size_t>(padding_end - padding_begin) * dtype_size(dtype),
              stream);
  }
  do_all_gather(at(fusion, rank_ * layout.shard, dtype), fusion, layout.shard, dtype, stream);
  unpack(fusion, outputs, 0, layout.total, stream);
  fusion_end(stream);
}

// ---- reduce-scatter

void Communicator::reduce_scatter(std::span<const TensorView> tensors, ReduceOp op, Stream stream) {
  scatter_list("reduce_scatter", tensors, tensors, op, stream);
}

void Communicator::reduce_scatter(std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                                  ReduceOp op, Stream stream) {
  scatter_list("reduce_scatter", inputs, outputs, op, stream);
}

void Communicator::scatter_list(std::string_view op, std::span<const TensorView> inputs,
                                std::span<const TensorView> outputs, ReduceOp reduce, Stream stream) {
  require_usable(op);
  const auto [in, out] = list_checks_->inspect(op, inputs, outputs, device_);
  if (checked_) check_fingerprint(op, static_cast<int>(CallKind::reduce_scatter), reduce, inputs);
  if (in.total == 0) return;

  const DType dtype = in.dtype;
  const ShardLayout layout = ShardLayout::of(in.total, dtype, size_);
  const int64_t mine = layout.begin(rank_), mine_end = layout.end(rank_);
  if (in.contiguous && out.contiguous && layout.padded_total == layout.total) {
    unsigned char* destination = at(out.base, mine, dtype);
    do_reduce_scatter(in.base, destination, layout.shard, dtype, stream);
    if (reduce == ReduceOp::average) divide(destination, layout.shard, dtype, size_, stream);
    return;
  }
  unsigned char* fusion = fusion_bytes(static_cast<size_t>(layout.padded_total) * dtype_size(dtype));
  fusion_begin(stream);
  pack(inputs, fusion, 0, layout.total, stream);
  if (layout.padded_total > layout.total) {
    fill_zero(at(fusion, layout.total, dtype),
              static_cast<size_t>(layout.padded_total - layout.total) * dtype_size(dtype), stream);
  }
  unsigned char* reduced = at(fusion, rank_ * layout.shard, dtype);
  do_reduce_scatter(fusion, reduced, layout.shard, dtype, stream);
  if (reduce == ReduceOp::average && mine_end > mine) divide(reduced, mine_end - mine, dtype, size_, stream);
  unpack(fusion, outputs, mine, mine_end, stream);
  fusion_end(stream);
}

// ---- flat buffers

namespace {

void check_buffer(std::string_view op, std::string_view arg, const TensorView& t, Device device) {
  comm::inspect_list(op, arg, std::span<const TensorView>(&t, 1), device);
}

// The names of one call's input and output in error messages: "input" and
// "output", or "inputs[i]" and "outputs[i]" for the i-th pair of a batch.
struct PairArgs {
  std::string input = "input", output = "output";
};

PairArgs pair_args(bool listed, size_t i) {
  if (!listed) return {};
  return {"inputs[" + std::to_string(i) + "]", "outputs[" + std::to_string(i) + "]"};
}

void check_pair_count(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  if (outputs.size() != inputs.size()) {
    throw_argument_error(ErrorCode::size_mismatch, op, "outputs",
                         "has " + std::to_string(outputs.size()) + " buffers, expected " +
                             std::to_string(inputs.size()) + " (one per input)");
  }
}

void check_not_overlapping(std::string_view op, const PairArgs& args, const TensorView& output,
                           const TensorView& input, const std::string& why) {
  const auto* a = static_cast<const unsigned char*>(output.data);
  const auto* b = static_cast<const unsigned char*>(input.data);
  if (output.numel > 0 && input.numel > 0 && a < b + input.bytes() && b < a + output.bytes()) {
    throw_argument_error(ErrorCode::aliasing, op, args.output, "overlaps '" + args.input + "', expected " + why);
  }
}

void check_dtype(std::string_view op, const PairArgs& args, const TensorView& output, const TensorView& input) {
  if (output.dtype != input.dtype) {
    throw_argument_error(ErrorCode::invalid_argument, op, args.output,
                         "is " + std::string(dtype_name(output.dtype)) + ", expected " +
                             std::string(dtype_name(input.dtype)) + " (the dtype of '" + args.input + "')");
  }
}

void check_count(std::string_view op, std::string_view arg, int64_t got, int64_t want, const std::string& why) {
  if (got != want) {
    throw_argument_error(ErrorCode::size_mismatch, op, arg,
                         "has " + std::to_string(got) + " elements, expected " + std::to_string(want) + " (" + why +
                             ")");
  }
}

}  // namespace

void Communicator::all_reduce_buffer(const TensorView& input, const TensorView& output, ReduceOp op, Stream stream) {
  constexpr std::string_view name = "all_reduce_buffer";
  require_usable(name);
  check_buffer(name, "input", input, device_);
  check_buffer(name, "output", output, device_);
  check_dtype(name, {}, output, input);
  check_count(name, "output", output.numel, input.numel, "the size of 'input'");
  if (output.data != input.data) check_not_overlapping(name, {}, output, input, "the same buffer or none of it");
  if (checked_) check_fingerprint(name, static_cast<int>(CallKind::all_reduce_buffer), op, {&input, 1});
  if (input.numel == 0) return;
  do_all_reduce(input.data, output.data, input.numel, input.dtype, stream);
  if (op == ReduceOp::average) divide(output.data, output.numel, output.dtype, size_, stream);
}

void Communicator::all_gather_buffer(const TensorView& input, const TensorView& output, Stream stream) {
  gather_buffers("all_gather_buffer", static_cast<int>(CallKind::all_gather_buffer), {&input, 1}, {&output, 1},
                 false, stream);
}

void Communicator::all_gather_buffers(std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                                      Stream stream) {
  gather_buffers("all_gather_buffers", static_cast<int>(CallKind::all_gather_buffers), inputs, outputs, true, stream);
}

void Communicator::reduce_scatter_buffer(const TensorView& input, const TensorView& output, ReduceOp op,
                                         Stream stream) {
  scatter_buffers("reduce_scatter_buffer", static_cast<int>(CallKind::reduce_scatter_buffer), {&input, 1},
                  {&output, 1}, op, false, stream);
}

void Communicator::reduce_scatter_buffers(std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                                          ReduceOp op, Stream stream) {
  scatter_buffers("reduce_scatter_buffers", static_cast<int>(CallKind::reduce_scatter_buffers), inputs, outputs, op,
                  true, stream);
}

std::vector<Communicator::BufferCall> Communicator::check_buffer_pairs(std::string_view name,
                                                                      std::span<const TensorView> inputs,
                                                                      std::span<const TensorView> outputs,
                                                                      bool listed, bool gather) const {
  check_pair_count(name, inputs, outputs);
  std::vector<BufferCall> calls;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const PairArgs args = pair_args(listed, i);
    const TensorView& input = inputs[i];
    const TensorView& output = outputs[i];
    check_buffer(name, args.input, input, device_);
    check_buffer(name, args.output, output, device_);
    check_dtype(name, args, output, input);
    // The whole buffer holds size() times the part; the part is rank()'s
    // slice of the whole (in place) or lies apart from it.
    const TensorView& whole = gather ? output : input;
    const TensorView& part = gather ? input : output;
    const std::string& whole_arg = gather ? args.output : args.input;
    const std::string& part_arg = gather ? args.input : args.output;
    check_count(name, whole_arg, whole.numel, part.numel * size_,
                "size() = " + std::to_string(size_) + " times the size of '" + part_arg + "'");
    if (part.data != at(static_cast<unsigned char*>(whole.data), part.numel * rank_, part.dtype)) {
      check_not_overlapping(name, args, output, input, "rank()'s slice of '" + whole_arg + "' or none of it");
    }
    if (part.numel > 0) calls.push_back({input.data, output.data, part.numel, input.dtype});
  }
  return calls;
}

void Communicator::gather_buffers(std::string_view name, int kind, std::span<const TensorView> inputs,
                                  std::span<const TensorView> outputs, bool listed, Stream stream) {
  require_usable(name);
  const std::vector<BufferCall> calls = check_buffer_pairs(name, inputs, outputs, listed, /*gather=*/true);
  if (checked_) check_fingerprint(name, kind, ReduceOp::sum, inputs);
  if (calls.size() == 1) {
    do_all_gather(calls[0].input, calls[0].output, calls[0].count_per_rank, calls[0].dtype, stream);
  } else if (!calls.empty()) {
    do_all_gathers(calls, stream);
  }
}

void Communicator::scatter_buffers(std::string_view name, int kind, std::span<const TensorView> inputs,
                                   std::span<const TensorView> outputs, ReduceOp op, bool listed, Stream stream) {
  require_usable(name);
  const std::vector<BufferCall> calls = check_buffer_pairs(name, inputs, outputs, listed, /*gather=*/false);
  if (checked_) check_fingerprint(name, kind, op, outputs);
  if (calls.size() == 1) {
    do_reduce_scatter(calls[0].input, calls[0].output, calls[0].count_per_rank, calls[0].dtype, stream);
  } else if (!calls.empty()) {
    do_reduce_scatters(calls, stream);
  }
  if (op != ReduceOp::average) return;
  for (const BufferCall& c : calls) divide(c.output, c.count_per_rank, c.dtype, size_, stream);
}

void Communicator::do_all_gathers(std::span<const BufferCall> calls, Stream stream) {
  for (const BufferCall& c : calls) do_all_gather(c.input, c.output, c.count_per_rank, c.dtype, stream);
}

void Communicator::do_reduce_scatters(std::span<const BufferCall> calls, Stream stream) {
  for (const BufferCall& c : calls) do_reduce_scatter(c.input, c.output, c.count_per_rank, c.dtype, stream);
}

void Communicator::exchange(const TensorView& send, const TensorView& receive, int peer, Stream stream) {
  constexpr std::string_view name = "exchange";
  require_usable(name);
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw_argument_error(ErrorCode::invalid_argument, name, "peer",
                         "is " + std::to_string(peer) + ", expected another rank in [0, " + std::to_string(size_) +
                             ") than this one (" + std::to_string(rank_) + ")");
  }
  check_buffer(name, "send", send, device_);
  check_buffer(name, "receive", receive, device_);
  if (receive.bytes() != send.bytes()) {
    throw_argument_error(ErrorCode::size_mismatch, name, "receive",
                         "has " + std::to_string(receive.bytes()) + " bytes, expected " +
                             std::to_string(send.bytes()) + " (the size of 'send')");
  }
  check_not_overlapping(name, {.input = "send", .output = "receive"}, receive, send,
                        "separate send and receive buffers");
  if (send.numel == 0) return;
  do_exchange(send.data, receive.data, send.bytes(), peer, stream);
}

void Communicator::all_to_all(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& receive,
                              std::span<const int64_t> receive_counts, Stream stream) {
  constexpr std::string_view name = "all_to_all";
  require_usable(name);
  check_buffer(name, "send", send, device_);
  check_buffer(name, "receive", receive, device_);
  if (receive.dtype != send.dtype) {
    throw_argument_error(ErrorCode::dtype_unsupported, name, "receive",
                         "has dtype " + std::string(dtype_name(receive.dtype)) + ", expected " +
                             std::string(dtype_name(send.dtype)) + " (the dtype of 'send')");
  }
  // Each list: one count per rank, each >= 0, adding up to its buffer's elements.
  const auto sections = [&](std::string_view arg, std::span<const int64_t> counts, const TensorView& buffer,
                            std::vector<size_t>& bytes, std::vector<size_t>& offsets) {
    if (counts.size() != static_cast<size_t>(size_)) {
      throw_argument_error(ErrorCode::size_mismatch, name, arg,
                           "has " + std::to_string(counts.size()) + " entries, expected one per rank (" +
                               std::to_string(size_) + ")");
    }
    int64_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      if (counts[r] < 0 || counts[r] > buffer.numel - total) {
        std::string what = "has ";
        what.append(std::to_string(counts[r])).append(" elements for rank ").append(std::to_string(r));
        what.append(", expected a count >= 0 within the buffer's ").append(std::to_string(buffer.numel));
        throw_argument_error(ErrorCode::size_mismatch, name, arg, what + " elements");
      }
      offsets.push_back(static_cast<size_t>(total) * dtype_size(buffer.dtype));
      bytes.push_back(static_cast<size_t>(counts[r]) * dtype_size(buffer.dtype));
      total += counts[r];
    }
    if (total != buffer.numel) {
      throw_argument_error(ErrorCode::size_mismatch, name, arg,
                           "adds up to " + std::to_string(total) + " elements, expected the buffer's " +
                               std::to_string(buffer.numel));
    }
  };
  std::vector<size_t> to_bytes, to_offsets, from_bytes, from_offsets;
  sections("send_counts", send_counts, send, to_bytes, to_offsets);
  sections("receive_counts", receive_counts, receive, from_bytes, from_offsets);
  // This rank's own section is copied: both sides must be its size (the
  // other ranks' agreement cannot be checked here).
  const auto me = static_cast<size_t>(rank_);
  if (receive_counts[me] != send_counts[me]) {
    throw_argument_error(ErrorCode::size_mismatch, name, "receive_counts",
                         "has " + std::to_string(receive_counts[me]) + " elements from this rank (" +
                             std::to_string(rank_) + ") to itself, expected send_counts' " +
                             std::to_string(send_counts[me]));
  }
  if (send.numel > 0 && receive.numel > 0) {
    check_not_overlapping(name, {.input = "send", .output = "receive"}, receive, send,
                          "separate send and receive buffers");
  }
  do_all_to_all(send.data, {to_bytes, to_offsets}, receive.data, {from_bytes, from_offsets}, stream);
}

namespace {

void check_peer(std::string_view op, int peer, int rank, int size) {
  if (peer < 0 || peer >= size || peer == rank) {
    throw_argument_error(ErrorCode::invalid_argument, op, "peer",
                         "is " + std::to_string(peer) + ", expected another rank in [0, " + std::to_string(size) +
                             ") than this one (" + std::to_string(rank) + ")");
  }
}

}  // namespace

void Communicator::send(const TensorView& data, int peer, Stream stream) {
  constexpr std::string_view name = "send";
  require_usable(name);
  check_peer(name, peer, rank_, size_);
  check_buffer(name, "data", data, device_);
  if (data.numel == 0) return;
  do_send(data.data, data.bytes(), peer, stream);
}

void Communicator::receive(const TensorView& data, int peer, Stream stream) {
  constexpr std::string_view name = "receive";
  require_usable(name);
  check_peer(name, peer, rank_, size_);
  check_buffer(name, "data", data, device_);
  if (data.numel == 0) return;
  do_receive(data.data, data.bytes(), peer, stream);
}

void Communicator::barrier() {
  require_usable("barrier");
  do_barrier();
}

}  // namespace gradkit
