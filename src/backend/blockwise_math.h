// The encode and decode of 8-bit blockwise moments (include/gradkit/ops/
// blockwise.h), written once and compiled for both backends, so that the CPU
// and CUDA kernels store the same byte for the same value.
#pragma once

#include <cstdint>

#include "backend/exact_math.h"
#include "backend/master_math.h"  // float_bits
#include "gradkit/ops/blockwise.h"

namespace gradkit::backend {

// Where a value's search starts: |x| in [0, 1] is cut into buckets by its
// f32 bit pattern (its exponent and the top kQuantMantissaBits of its
// fraction; every |x| below 2^-(kQuantExponents - 1) falls in bucket 0), one
// set for each sign, and each bucket keeps the number of decision points
// below its lowest value. Within a bucket at most kQuantSpan decision points
// lie (checked when the tables are built), so kQuantSpan comparisons finish
// the count that the binary search (quantize_search) would give: the same
// code for every x, in 2 table reads instead of 8.
inline constexpr int kQuantMantissaBits = 7;
inline constexpr int kQuantExponents = 25;
inline constexpr int kQuantBuckets = kQuantExponents << kQuantMantissaBits;  // per sign
inline constexpr int kQuantSpan = 1;
inline constexpr uint32_t kQuantLowestBits = static_cast<uint32_t>(127 - (kQuantExponents - 1)) << 23;  // 2^-24

// One code table as the kernels read it: the 256 codes, ascending, the 255
// decision points between neighbours (midpoints[i] between codes i and i + 1,
// the f64 midpoint rounded to f32 once, on the host), and the buckets' starts
// (positive x, then negative x).
struct QuantTable {
  float codes[256];
  float midpoints[256];  // 255 used; the last is +Inf, never passed
  uint8_t start[2 * kQuantBuckets];
  // The lowest code a positive value may take: 1 for the unsigned map (a
  // positive exp_avg_sq never encodes as 0: docs/ops.md), 0 (no floor) for
  // the signed one.
  int32_t positive_floor;
};

// The lowest code a positive value may take in each map (QuantTable::
// positive_floor): none for exp_avg's signed map, 1 for exp_avg_sq's.
inline constexpr int32_t kExpAvgFloor = 0;
inline constexpr int32_t kExpAvgSqFloor = 1;

// The bucket of a magnitude's bit pattern (at most 1.0f's): the bits above
// the lowest bucket's, shifted. The lowest bucket's pattern has no bits
// below the shift, so the subtraction can follow the shift (a constant the
// compiler folds into the table's address).
static_assert((kQuantLowestBits & ((1u << (23 - kQuantMantissaBits)) - 1)) == 0);
GRADKIT_HD int quant_bucket(uint32_t magnitude) {
  const uint32_t clamped = magnitude > kQuantLowestBits ? magnitude : kQuantLowestBits;
  return static_cast<int>(clamped >> (23 - kQuantMantissaBits)) -
         static_cast<int>(kQuantLowestBits >> (23 - kQuantMantissaBits));
}

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
// number of decision points below x, found by a branch-free binary search.
// A value exactly on a decision point takes the lower code. NaN gives 0.
// The count alone; quantize() gives the same count and then the floor.
GRADKIT_HD uint8_t quantize_search(const QuantTable& t, float x) {
  int q = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int step = 128; step > 0; step >>= 1) q += x > t.midpoints[q + step - 1] ? step : 0;
  return static_cast<uint8_t>(q);
}

// The code of x: quantize_search's count, from the bucket's start and
// kQuantSpan comparisons (a comparison past the bucket's last decision point
// is false, so the count stops there), without a branch; then a positive x
// takes at least the table's positive_floor. |x| > 1 (a rounding of
// m * (1 / absmax) may pass 1) takes 1.0's bucket: its positive start is 255
// (every decision point lies below 1), its negative start 0, which is the
// search's count for x > 1 and x < -1. NaN gives 0, as the search does.
// `floor` is the table's positive_floor; quantize_with_floor takes it as a
// compile-time constant where the caller knows which map it encodes (the
// CUDA kernels: a floor of 0 then costs nothing).
GRADKIT_HD uint8_t quantize_with_floor(const QuantTable& t, float x, int32_t floor) {
  const uint32_t bits = float_bits(x);
  uint32_t magnitude = bits & 0x7fffffffu;  // -0 is 0
  magnitude = magnitude < 0x3f800000u ? magnitude : 0x3f800000u;
  int q = t.start[quant_bucket(magnitude) + static_cast<int>(bits >> 31) * kQuantBuckets];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kQuantSpan; ++k) q += x > t.midpoints[q] ? 1 : 0;
  q = x > 0.0f && q < floor ? floor : q;
  return static_cast<uint8_t>(x == x ? q : 0);
}

GRADKIT_HD uint8_t quantize(const QuantTable& t, float x) { return quantize_with_floor(t, x, t.positive_floor); }

GRADKIT_HD float dequantize(const QuantTable& t, uint8_t q, float absmax) { return exact::mul(t.codes[q], absmax); }

}  // namespace gradkit::backend
