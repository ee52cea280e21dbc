// The encode and decode of 8-bit blockwise moments (include/gradkit/ops/
// low_bit.h), written once and compiled for both backends, so that the CPU
// and CUDA kernels store the same byte for the same value.
#pragma once

#include <cstdint>

#include "spec/exact_math.h"
#include "spec/master_math.h"  // float_bits
#include "gradkit/ops/low_bit.h"

namespace gradkit::spec {

// Where a value's search starts: |x| in [0, 4) is cut into buckets by its
// f32 bit pattern (its exponent and the top MantissaBits of its fraction;
// every |x| below 2^-(Exponents - 2) falls in bucket 0), one set for each
// sign, and each bucket keeps the number of decision points below its
// lowest value (a table's `start`). Within a bucket at most kQuantSpan
// decision points lie (checked when the tables are built), so kQuantSpan
// comparisons finish the count that the binary search (count_below) gives:
// the same code for every x, in 2 table reads instead of log2(codes). Each
// form picks the fewest buckets that keep its decision points apart (the
// 8-bit maps' 7 fraction bits over 26 exponents; the 4-bit maps',
// low_bit_int4_math.h, 3 over 12).
inline constexpr int kQuantSpan = 1;
template <int MantissaBits, int Exponents>
struct QuantBuckets {
  static constexpr int kMantissaBits = MantissaBits;
  static constexpr int kCount = Exponents << MantissaBits;  // per sign
  static constexpr uint32_t kLowestBits = static_cast<uint32_t>(127 - (Exponents - 2)) << 23;
  static constexpr int kShift = 23 - MantissaBits;
  // The lowest bucket's pattern has no bits below the shift, so the
  // subtraction can follow the shift (a constant the compiler folds into the
  // table's address).
  static_assert((kLowestBits & ((1u << kShift) - 1)) == 0);
  // The bucket of a magnitude's bit pattern (at most kQuantNanBits).
  static GRADKIT_HD int of(uint32_t magnitude) {
    const uint32_t clamped = magnitude > kLowestBits ? magnitude : kLowestBits;
    return static_cast<int>(clamped >> kShift) - static_cast<int>(kLowestBits >> kShift);
  }
};
using Quant8Buckets = QuantBuckets<7, 26>;  // 2^-24 .. 2^1
inline constexpr int kQuantMantissaBits = Quant8Buckets::kMantissaBits;
inline constexpr int kQuantBuckets = Quant8Buckets::kCount;
inline constexpr uint32_t kQuantLowestBits = Quant8Buckets::kLowestBits;
// The bucket every NaN falls in (the encodes clamp magnitudes to 2.0's
// bits; no finite x reaches 2, since |value| <= absmax): its start is 0 for
// both signs, and a comparison with NaN is false, so a NaN encodes as 0
// without a rule of its own.
inline constexpr uint32_t kQuantNanBits = 0x40000000u;  // 2.0f

// One code table as the kernels read it: the 256 codes, ascending, the 255
// decision points between neighbours (midpoints[i] between codes i and i + 1,
// the f64 midpoint rounded to f32 once, on the host), and the buckets' starts
// (positive x, then negative x).
//
// The unsigned map's first decision point is 0, not the midpoint of its
// codes 0 and 1: a positive exp_avg_sq value never encodes as 0 (docs/ops.md),
// and counting the decision points below x with that one at 0 is exactly
// "the nearest code, then at least code 1 for a positive x". The floor is
// thus part of the table, and costs the encode nothing.
struct QuantTable {
  using Buckets = Quant8Buckets;
  float codes[256];
  float midpoints[256];  // 255 used; the last is +Inf, never passed
  uint8_t start[2 * Buckets::kCount];
};

// Both tables, exp_avg's (signed) then exp_avg_sq's (unsigned).
struct QuantTables {
  QuantTable table[2];
};

// A block's absolute maximum, folded one value at a time on the bit
// patterns with the sign cleared, whose integer order is the order of the
// magnitudes, with every NaN above +Inf: a NaN anywhere makes the absmax a
// NaN (a float max would drop it), so a non-finite moment is not hidden by
// its block's encoding. Integer max does not depend on the order, so any
// reduction tree gives the same bits. Two integer operations per value.
GRADKIT_HD uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7fffffffu; }
GRADKIT_HD uint32_t absmax_bits_fold(uint32_t absmax_bits, uint32_t magnitude) {
  return magnitude > absmax_bits ? magnitude : absmax_bits;
}
GRADKIT_HD float absmax_fold(float absmax, float x) {
  return bits_float(absmax_bits_fold(magnitude_bits(absmax), magnitude_bits(x)));
}

// The multiplier that maps a block onto [-1, 1]: 1 / absmax, or 0 for an
// all-zero block (every value then encodes as the code 0). An Inf absmax
// gives 0 too, a NaN absmax NaN: the block decodes to Inf/NaN either way.
GRADKIT_HD float quant_scale(float absmax) { return absmax == 0.0f ? 0.0f : 1.0f / absmax; }

// The index of the code nearest to x (x already scaled into [-1, 1]): the
// count of decision points below x among the N - 1 of an N-entry table
// (midpoints[N - 1] is +Inf), by a branch-free binary search of log2(N)
// steps. A value exactly on a decision point takes the lower code; NaN
// gives 0. The definition of both forms' encodes: bucketed_count gives the
// same count without a search.
template <int N>
GRADKIT_HD uint8_t count_below(const float (&midpoints)[N], float x) {
  static_assert(N >= 2 && (N & (N - 1)) == 0, "a power of two");
  int q = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int step = N / 2; step > 0; step >>= 1) q += x > midpoints[q + step - 1] ? step : 0;
  return static_cast<uint8_t>(q);
}

GRADKIT_HD uint8_t quantize_search(const QuantTable& t, float x) { return count_below(t.midpoints, x); }

// The code of x in a table with bucket starts (QuantTable, QuantTable4):
// count_below's count, from the bucket's start and kQuantSpan comparisons (a
// comparison past the bucket's last decision point is false, so the count
// stops there), without a branch. 1 < |x| < 2 (a rounding of m * (1 /
// absmax) may pass 1): the positive start is N - 1 (every decision point
// lies below 1; midpoints[N - 1] is +Inf), the negative start 0, which is
// the search's count for x > 1 and x < -1. NaN (clamped into the bucket of
// 2.0, whose starts are 0, and greater than nothing) gives 0, as the search
// does. The CPU backend's encode; the CUDA kernels' gives the same count in
// fewer instructions (cuda/low_bit_codecs.cuh, bucketed_count_cuda), and
// like it the count comes back in 32 bits (below N by the table's
// construction).
template <class Table>
GRADKIT_HD uint32_t bucketed_count(const Table& t, float x) {
  using Buckets = typename Table::Buckets;
  const uint32_t bits = float_bits(x);
  uint32_t magnitude = bits & 0x7fffffffu;  // -0 is 0
  magnitude = magnitude < kQuantNanBits ? magnitude : kQuantNanBits;
  int q = t.start[Buckets::of(magnitude) + static_cast<int>(bits >> 31) * Buckets::kCount];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kQuantSpan; ++k) q += x > t.midpoints[q] ? 1 : 0;
  return static_cast<uint32_t>(q);
}

GRADKIT_HD uint8_t quantize(const QuantTable& t, float x) { return static_cast<uint8_t>(bucketed_count(t, x)); }

// q: a code (below 256), in any unsigned width: the CUDA kernels take it
// from a byte of a word as it is, with no narrowing to mask it again.
GRADKIT_HD float dequantize(const QuantTable& t, uint32_t q, float absmax) { return exact::mul(t.codes[q], absmax); }

}  // namespace gradkit::spec
