// What one rank does in an Adasum all-reduce, worked out once per plan from
// the world size, this rank, the node size and the list's element counts:
// the steps in order, each with its peer and the element ranges it sends,
// keeps or receives, and for the steps that combine, a table of the kept
// range's pieces cut at tensor boundaries (so that the dot products and
// norms are per tensor even where a halving cuts through a tensor).
//
// The whole list is one flat vector of `padded` elements: the concatenation
// of the tensors, then zeros up to a multiple of the active ranks (each
// final segment a multiple of 32 bytes, ShardLayout's rule), so that every
// halving is exact. The zeros are one more "tensor" (index num_tensors):
// its norms are zero, its coefficients 1, and it stays zero.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "gradkit/core/dtype.h"

namespace gradkit::comm::adasum {

// Elements [begin, begin + length) of the flat vector, all of tensor `tensor`.
struct Piece {
  int64_t begin;
  int32_t tensor;
  int32_t length;
};

// The pieces of one kept range, in order, at most kPieceElements each;
// tensor t's pieces are [first_piece[t], first_piece[t + 1]) (empty for a
// tensor outside the range), for t in [0, num_tensors] (the padding last).
struct PieceTable {
  std::vector<Piece> pieces;
  std::vector<int32_t> first_piece;  // num_tensors + 2 entries
};

inline constexpr int64_t kPieceElements = 65536;

enum class StepKind {
  sum_halving,     // within a node: keep a half, send the other, add the peer's half
  adasum_halving,  // across nodes: keep a half, send the other, adasum-combine with the peer's half
  fold_send,       // a rank past the power of two sends its segment to its partner ...
  fold_combine,    // ... which adasum-combines it into its own
  gather,          // the reverse of a halving: send the kept range, receive the sent one
  unfold_send,     // the partner sends the result's segment back ...
  unfold_receive,  // ... to the rank past the power of two
};

struct Step {
  StepKind kind;
  int peer;
  int64_t keep_begin = 0, keep_count = 0;  // what this rank keeps (combines, or sends back in a gather)
  int64_t send_begin = 0, send_count = 0;  // what it sends (receives, in a gather)
  bool mine_is_a = true;  // this rank's values are `a` of adasum(a, b): it holds the lower group's vector
  // The dot products and norms are summed over the ranks that differ from
  // this one only in the bits [0, group_bits) (recursive doubling).
  int group_bits = 0;
  int table = -1;  // index into Schedule::tables for adasum steps
};

struct Schedule {
  int64_t total = 0;    // elements of the list
  int64_t padded = 0;   // elements of the flat vector
  int num_tensors = 0;
  std::vector<Step> steps;
  std::vector<PieceTable> tables;
  int64_t receive_elements = 0;  // the largest range received in one step
  int64_t bytes_sent = 0;        // by this rank in one call (in elements times dtype size)
};

// `ranks_per_node` is 1 for flat Adasum; for hierarchical, a power of two
// dividing `size` (checked by the caller): node n is the ranks
// [n * ranks_per_node, (n + 1) * ranks_per_node).
Schedule make_schedule(int rank, int size, int ranks_per_node, std::span<const int64_t> numels, DType dtype);

// The pieces of [begin, begin + count) given the tensors' offsets in the flat vector.
PieceTable make_piece_table(std::span<const int64_t> tensor_begin, int64_t begin, int64_t count);

}  // namespace gradkit::comm::adasum
