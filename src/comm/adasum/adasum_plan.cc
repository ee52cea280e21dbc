// Adasum's driver: validates the list and options, works out this rank's
// schedule (schedule.cc) once, uploads its tables, and on each run moves the
// data between ranks with the communicator's point-to-point primitives and
// calls the device's arithmetic (spec/adasum.h) in between.
//
// The per-tensor dot products and norms of a combining step are summed over
// the 2d ranks holding the two vectors by recursive doubling on exchanges
// (log2(2d) exchanges of 3 doubles per tensor, all tensors in one message),
// not by an all-reduce on a sub-communicator: the exchange is a primitive
// both engines already have, so no communicator per level has to be split
// off (an NCCL communicator each, made collectively and kept), a small
// message costs log2(2d) latencies instead of a ring's 2(2d - 1), and since
// every rank adds the lower group's sums first, every rank of the group
// gets bitwise the same coefficients.
#include "gradkit/comm/adasum.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "spec/adasum.h"
#include "comm/adasum/schedule.h"
#include "comm/fingerprint.h"
#include "comm/tensor_list.h"
#include "gradkit/core/error.h"

namespace gradkit {

using comm::adasum::Piece;
using comm::adasum::Step;
using comm::adasum::StepKind;

namespace {

constexpr std::string_view kOp = "adasum";

bool is_power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// Arrays laid out one after another in one allocation, each aligned for its type.
class TableBytes {
 public:
  template <class T>
  size_t append(const std::vector<T>& values) {
    const size_t at = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(at + values.size() * sizeof(T));
    if (!values.empty()) std::memcpy(bytes_.data() + at, values.data(), values.size() * sizeof(T));
    return at;
  }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

}  // namespace

struct AdasumPlan::Impl {
  Communicator* comm = nullptr;
  std::vector<TensorView> tensors;
  DType dtype = DType::f32;
  uint32_t variant = 0;  // 0 for flat, the ranks per node for hierarchical
  comm::adasum::Schedule schedule;
  std::unique_ptr<comm::adasum::AdasumDevice> device;

  // Where every step works: the padded concatenation of the list, in a
  // buffer of the plan's own, or the list's own memory when the list is one
  // contiguous range that needs no padding (a GradientArena's, say): then
  // nothing is packed or unpacked, two passes over the list fewer.
  Buffer flat;
  void* work = nullptr;
  Buffer received;       // the peer's half (or segment, for a fold)
  Buffer sums;           // 3 doubles per slot: a·b, |a|², |b|²
  Buffer sums_received;  // the group partner's sums
  Buffer piece_sums;     // 3 doubles per piece of the largest table
  Buffer tables;         // every piece table and the list's table, uploaded once
  std::vector<comm::adasum::TableView> views;
  comm::adasum::ListView list;

  TensorView flat_range(int64_t begin, int64_t count) const {
    return TensorView{flat_at(begin), count, dtype, comm->device()};
  }
  TensorView received_range(int64_t count) const { return received.view(dtype, 0, count); }
  void* flat_at(int64_t begin) const {
    return static_cast<unsigned char*>(work) + static_cast<size_t>(begin) * dtype_size(dtype);
  }

  void exchange(const TensorView& send, const TensorView& receive, int peer, Stream stream) {
    comm->do_exchange(send.data, receive.data, send.bytes(), peer, stream);
  }

  // The sums of this rank's kept range, then the group's total.
  void combine(const Step& step, Stream stream) {
    const comm::adasum::TableView& table = views[static_cast<size_t>(step.table)];
    auto* own = static_cast<double*>(sums.data());
    device->partial_sums(table, work, received.data(), step.keep_begin, step.mine_is_a, dtype, own, stream);
    const size_t count = 3 * static_cast<size_t>(table.num_slots);
    for (int bit = 0; bit < step.group_bits; ++bit) {
      const int partner = comm->rank() ^ (1 << bit);
      comm->do_exchange(own, sums_received.data(), count * sizeof(double), partner, stream);
      const bool theirs_first = ((comm->rank() >> bit) & 1) != 0;
      device->add_sums(own, static_cast<const double*>(sums_received.data()), static_cast<int64_t>(count),
                       theirs_first, stream);
    }
    device->combine(table, work, received.data(), step.keep_begin, step.mine_is_a, dtype, own, stream);
  }

  void run_step(const Step& step, Stream stream) {
    switch (step.kind) {
      case StepKind::sum_halving:
        exchange(flat_range(step.send_begin, step.send_count), received_range(step.keep_count), step.peer, stream);
        device->add(flat_at(step.keep_begin), received.data(), step.keep_count, dtype, stream);
        return;
      case StepKind::adasum_halving:
        exchange(flat_range(step.send_begin, step.send_count), received_range(step.keep_count), step.peer, stream);
        combine(step, stream);
        return;
      case StepKind::fold_send:
      case StepKind::unfold_send: {
        const TensorView data = flat_range(step.send_begin, step.send_count);
        comm->do_send(data.data, data.bytes(), step.peer, stream);
        return;
      }
      case StepKind::fold_combine: {
        const TensorView into = received_range(step.keep_count);
        comm->do_receive(into.data, into.bytes(), step.peer, stream);
        combine(step, stream);
        return;
      }
      case StepKind::unfold_receive: {
        const TensorView into = flat_range(step.keep_begin, step.keep_count);
        comm->do_receive(into.data, into.bytes(), step.peer, stream);
        return;
      }
      case StepKind::gather:
        exchange(flat_range(step.keep_begin, step.keep_count), flat_range(step.send_begin, step.send_count),
                 step.peer, stream);
        return;
    }
  }
};

AdasumPlan::AdasumPlan(Communicator& comm, std::span<const TensorView> tensors, AdasumOptions options)
    : impl_(std::make_unique<Impl>()) {
  comm.require_usable(kOp);
  const comm::ListInfo info = comm::inspect_list(kOp, "tensors", tensors, comm.device());
  comm::check_no_overlap(kOp, tensors, {});

  int ranks_per_node = 1;
  if (options.hierarchical) {
    if (options.ranks_per_node < 0) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, "options.ranks_per_node",
                           "is " + std::to_string(options.ranks_per_node) +
                               ", expected 0 (the local size) or a power of two dividing size()");
    }
    ranks_per_node = options.ranks_per_node == 0 ? comm.local_size() : options.ranks_per_node;
    if (!is_power_of_two(ranks_per_node) || comm.size() % ranks_per_node != 0) {
      throw_argument_error(ErrorCode::invalid_argument, kOp,
                           options.ranks_per_node == 0 ? "options.ranks_per_node (0: local_size())"
                                                       : "options.ranks_per_node",
                           "is " + std::to_string(ranks_per_node) + ", expected a power of two dividing size() = " +
                               std::to_string(comm.size()));
    }
    if (options.ranks_per_node == 0) {
      // Nodes are blocks of consecutive ranks: every rank checks every
      // rank's place on its host, so that all throw together or none.
      const int mine[2] = {comm.local_rank(), comm.local_size()};
      std::vector<int> all(2 * static_cast<size_t>(comm.size()));
      comm.host_all_gather(mine, all.data(), sizeof(mine));
      for (int r = 0; r < comm.size(); ++r) {
        const int local_rank = all[2 * static_cast<size_t>(r)], local_size = all[2 * static_cast<size_t>(r) + 1];
        if (local_size != ranks_per_node || local_rank != r % ranks_per_node) {
          throw_argument_error(ErrorCode::invalid_argument, kOp, "options.ranks_per_node (0: local_size())",
                               "needs the ranks of each host consecutive and as many on each host, but rank " +
                                   std::to_string(r) + " is local rank " + std::to_string(local_rank) + " of " +
                                   std::to_string(local_size) + ", expected local rank " +
                                   std::to_string(r % ranks_per_node) + " of " + std::to_string(ranks_per_node) +
                                   " (set ranks_per_node, or place ranks by slot)");
        }
      }
    }
  } else if (options.ranks_per_node != 0) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "options.ranks_per_node",
                         "is " + std::to_string(options.ranks_per_node) +
                             ", expected 0 unless options.hierarchical is set");
  }

  Impl& p = *impl_;
  p.comm = &comm;
  p.tensors.assign(tensors.begin(), tensors.end());
  p.dtype = info.dtype;
  p.variant = options.hierarchical ? static_cast<uint32_t>(ranks_per_node) : 0;
  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const TensorView& t : tensors) numels.push_back(t.numel);
  p.schedule = comm::adasum::make_schedule(comm.rank(), comm.size(), ranks_per_node, numels, p.dtype);
  if (info.total == 0) return;

  const Device device = comm.device();
  p.device = device.is_cuda() ? comm::adasum::make_cuda_adasum_device(device.index)
                              : comm::adasum::make_cpu_adasum_device();
  const size_t element = dtype_size(p.dtype);
  const comm::adasum::Schedule& s = p.schedule;
  if (info.contiguous && s.padded == info.total) {
    p.work = info.base;
  } else {
    p.flat = Buffer(device, static_cast<size_t>(s.padded) * element);  // zero-filled: the padding stays zero
    p.work = p.flat.data();
  }
  p.received = Buffer(device, static_cast<size_t>(s.receive_elements) * element);
  const size_t slots = static_cast<size_t>(s.num_tensors) + 1;
  p.sums = Buffer(device, 3 * slots * sizeof(double));
  p.sums_received = Buffer(device, 3 * slots * sizeof(double));
  size_t most_pieces = 0;
  for (const auto& table : s.tables) most_pieces = std::max(most_pieces, table.pieces.size());
  p.piece_sums = Buffer(device, 3 * most_pieces * sizeof(double));

  // The list's own table: its pieces without the padding, each tensor's data and offset.
  std::vector<int64_t> tensor_begin;
  std::vector<void*> pointers;
  int64_t offset = 0;
  for (const TensorView& t : tensors) {
    tensor_begin.push_back(offset);
    pointers.push_back(t.data);
    offset += t.numel;
  }
  std::vector<int64_t> bounds = tensor_begin;
  bounds.push_back(info.total);
  comm::adasum::PieceTable list_pieces = comm::adasum::make_piece_table(bounds, 0, info.total);

  TableBytes bytes;
  std::vector<size_t> piece_at, first_at;
  for (const auto& table : s.tables) {
    piece_at.push_back(bytes.append(table.pieces));
    first_at.push_back(bytes.append(table.first_piece));
  }
  const size_t list_pieces_at = bytes.append(list_pieces.pieces);
  const size_t pointers_at = bytes.append(pointers);
  const size_t tensor_begin_at = bytes.append(tensor_begin);
  p.tables = Buffer(device, bytes.bytes().size());
  copy_from_host(p.tables.data(), device, bytes.bytes().data(), bytes.bytes().size());

  auto* base = static_cast<unsigned char*>(p.tables.data());
  for (size_t i = 0; i < s.tables.size(); ++i) {
    comm::adasum::TableView view;
    view.pieces = reinterpret_cast<const Piece*>(base + piece_at[i]);
    view.num_pieces = static_cast<int64_t>(s.tables[i].pieces.size());
    view.first_piece = reinterpret_cast<const int32_t*>(base + first_at[i]);
    view.num_slots = static_cast<int32_t>(slots);
    view.piece_sums = static_cast<double*>(p.piece_sums.data());
    p.views.push_back(view);
  }
  p.list.pieces = reinterpret_cast<const Piece*>(base + list_pieces_at);
  p.list.num_pieces = static_cast<int64_t>(list_pieces.pieces.size());
  p.list.pointers = reinterpret_cast<void* const*>(base + pointers_at);
  p.list.tensor_begin = reinterpret_cast<const int64_t*>(base + tensor_begin_at);
  p.list.contiguous = info.contiguous ? info.base : nullptr;
  p.list.total = info.total;
}

AdasumPlan::~AdasumPlan() = default;
AdasumPlan::AdasumPlan(AdasumPlan&&) noexcept = default;
AdasumPlan& AdasumPlan::operator=(AdasumPlan&&) noexcept = default;

int64_t AdasumPlan::bytes_sent() const { return impl_->schedule.total == 0 ? 0 : impl_->schedule.bytes_sent; }

void AdasumPlan::run(Stream stream) {
  Impl& p = *impl_;
  p.comm->require_usable(kOp);
  if (p.comm->checked()) {
    p.comm->check_fingerprint(kOp, static_cast<int>(comm::CallKind::adasum), p.variant, p.tensors);
  }
  if (p.schedule.total == 0) return;
  const bool in_place = p.work != p.flat.data();
  if (!in_place) p.device->pack(p.list, p.work, p.dtype, stream);
  for (const Step& step : p.schedule.steps) p.run_step(step, stream);
  if (!in_place) p.device->unpack(p.list, p.work, p.dtype, stream);
}

void adasum_all_reduce(Communicator& comm, std::span<const TensorView> tensors, AdasumOptions options,
                       Stream stream) {
  AdasumPlan plan(comm, tensors, options);
  plan.run(stream);
  // The plan's buffers are freed on return: wait for the run first, with
  // the communicator's timeout.
  comm.wait(stream);
}

}  // namespace gradkit
