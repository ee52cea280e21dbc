#include "comm/adasum/schedule.h"

#include <algorithm>

#include "gradkit/comm/communicator.h"

namespace gradkit::comm::adasum {

namespace {

int log2_exact(int n) {
  int bits = 0;
  while ((1 << bits) < n) ++bits;
  return bits;
}

int floor_log2(int n) {
  int bits = 0;
  while ((2 << bits) <= n) ++bits;
  return bits;
}

// A range of the flat vector.
struct Segment {
  int64_t begin;
  int64_t count;
};

// The halving at bit `level`: the rank whose bit is 0 keeps the lower half.
Step halving(StepKind kind, int rank, int level, Segment& segment) {
  const int64_t half = segment.count / 2;  // exact: the padded length divides by every active rank count
  const bool upper = ((rank >> level) & 1) != 0;
  Step step{kind, rank ^ (1 << level)};
  step.keep_begin = upper ? segment.begin + half : segment.begin;
  step.send_begin = upper ? segment.begin : segment.begin + half;
  step.keep_count = step.send_count = half;
  step.mine_is_a = !upper;
  step.group_bits = level + 1;
  segment = {step.keep_begin, half};
  return step;
}

Step reversed(const Step& halving) {
  Step step = halving;
  step.kind = StepKind::gather;
  step.table = -1;
  return step;
}

}  // namespace

PieceTable make_piece_table(std::span<const int64_t> tensor_begin, int64_t begin, int64_t count) {
  // tensor_begin has num_tensors + 2 entries: each tensor's start, the
  // padding's start, and the padded end.
  const auto slots = static_cast<int32_t>(tensor_begin.size() - 1);
  PieceTable table;
  table.first_piece.assign(static_cast<size_t>(slots) + 1, 0);
  const int64_t end = begin + count;
  for (int32_t t = 0; t < slots; ++t) {
    table.first_piece[static_cast<size_t>(t)] = static_cast<int32_t>(table.pieces.size());
    const int64_t first = std::max(begin, tensor_begin[static_cast<size_t>(t)]);
    const int64_t last = std::min(end, tensor_begin[static_cast<size_t>(t) + 1]);
    for (int64_t at = first; at < last; at += kPieceElements) {
      table.pieces.push_back({at, t, static_cast<int32_t>(std::min(kPieceElements, last - at))});
    }
  }
  table.first_piece[static_cast<size_t>(slots)] = static_cast<int32_t>(table.pieces.size());
  return table;
}

Schedule make_schedule(int rank, int size, int ranks_per_node, std::span<const int64_t> numels, DType dtype) {
  Schedule s;
  s.num_tensors = static_cast<int>(numels.size());
  for (int64_t n : numels) s.total += n;

  const int node_bits = log2_exact(ranks_per_node);
  const int nodes = size / ranks_per_node;
  const int node_levels = floor_log2(nodes);           // VHDD levels across nodes
  const int active_nodes = 1 << node_levels;           // nodes past these fold into the first ones
  const int active_ranks = active_nodes * ranks_per_node;
  const int node = rank / ranks_per_node;
  const int folded_nodes = nodes - active_nodes;
  s.padded = ShardLayout::of(s.total, dtype, active_ranks).padded_total;

  std::vector<int64_t> tensor_begin;
  tensor_begin.reserve(numels.size() + 2);
  int64_t offset = 0;
  for (int64_t n : numels) {
    tensor_begin.push_back(offset);
    offset += n;
  }
  tensor_begin.push_back(s.total);   // the padding ...
  tensor_begin.push_back(s.padded);  // ... up to the end
  auto add_table = [&](Step& step) {
    step.table = static_cast<int>(s.tables.size());
    s.tables.push_back(make_piece_table(tensor_begin, step.keep_begin, step.keep_count));
  };

  Segment segment{0, s.padded};
  std::vector<Step> halvings;
  // 1. Within the node: a reduce-scatter by recursive halving, which leaves
  //    each rank the segment that VHDD at level node_bits starts from.
  for (int level = 0; level < node_bits; ++level) {
    halvings.push_back(halving(StepKind::sum_halving, rank, level, segment));
    s.steps.push_back(halvings.back());
  }
  const Segment node_segment = segment;
  const int fold_peer_distance = active_nodes * ranks_per_node;

  if (node >= active_nodes) {
    // 2. A node past the power of two: its ranks hand their segments to the
    //    same local ranks of node (node - active_nodes), and get the result back.
    Step out{StepKind::fold_send, rank - fold_peer_distance};
    out.send_begin = node_segment.begin;
    out.send_count = node_segment.count;
    s.steps.push_back(out);
    Step back{StepKind::unfold_receive, rank - fold_peer_distance};
    back.keep_begin = node_segment.begin;
    back.keep_count = node_segment.count;
    s.steps.push_back(back);
  } else {
    if (node < folded_nodes) {
      // The partner's segment is `b`; the sums span this node's ranks, which
      // together hold both nodes' whole vectors.
      Step fold{StepKind::fold_combine, rank + fold_peer_distance};
      fold.keep_begin = node_segment.begin;
      fold.keep_count = node_segment.count;
      fold.mine_is_a = true;
      fold.group_bits = node_bits;
      add_table(fold);
      s.steps.push_back(fold);
    }
    // 3. VHDD across the active nodes: at level l the 2^(l+1) ranks that
    //    differ only in bits [0, l] hold, between them, the two vectors being combined.
    std::vector<Step> across;
    for (int level = node_bits; level < node_bits + node_levels; ++level) {
      Step step = halving(StepKind::adasum_halving, rank, level, segment);
      add_table(step);
      s.steps.push_back(step);
      across.push_back(step);
    }
    // 4. Distance-halving all-gather across nodes, then the result back to
    //    the folded partner.
    for (auto it = across.rbegin(); it != across.rend(); ++it) s.steps.push_back(reversed(*it));
    if (node < folded_nodes) {
      Step back{StepKind::unfold_send, rank + fold_peer_distance};
      back.send_begin = node_segment.begin;
      back.send_count = node_segment.count;
      s.steps.push_back(back);
    }
  }
  // 5. All-gather within the node.
  for (auto it = halvings.rbegin(); it != halvings.rend(); ++it) s.steps.push_back(reversed(*it));

  const size_t element_bytes = dtype_size(dtype);
  for (const Step& step : s.steps) {
    // A gather sends its kept range and receives into its sent range.
    const int64_t sent = step.kind == StepKind::gather ? step.keep_count : step.send_count;
    s.bytes_sent += sent * static_cast<int64_t>(element_bytes);
    if (step.kind == StepKind::sum_halving || step.kind == StepKind::adasum_halving) {
      s.receive_elements = std::max(s.receive_elements, step.keep_count);
    }
    if (step.kind == StepKind::fold_combine) s.receive_elements = std::max(s.receive_elements, step.keep_count);
  }
  return s;
}

}  // namespace gradkit::comm::adasum
