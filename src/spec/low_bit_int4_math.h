// The encode and decode of 4-bit blockwise moments (include/gradkit/ops/
// low_bit.h), written once and compiled for both backends, so that the CPU
// and CUDA kernels store the same nibble for the same value. The absmax of a
// block and the scale (1 / absmax) are the 8-bit form's (low_bit_int8_math.h).
#pragma once

#include <cstdint>

#include "spec/low_bit_int8_math.h"

namespace gradkit::spec {

// The 4-bit maps' buckets (low_bit_int8_math.h, QuantBuckets): 3 fraction bits
// over 12 exponents, 2^-10 .. 2^1. Their decision points lie no closer than
// an eighth of their exponent's range (the unsigned map's five in [0.5, 1):
// 0.55, 0.6625, 0.775, 0.8875, 0.971875), and the smallest is 0.00275
// (above 2^-9), so each bucket holds at most one; the tables' build checks it.
using Quant4Buckets = QuantBuckets<3, 12>;

// One 16-entry table: the codes, ascending, the decision points between
// neighbours (midpoints[i] between codes i and i + 1, the f64 midpoint
// rounded to f32 once, on the host; midpoints[15] is +Inf, never passed),
// and the buckets' starts (positive x, then negative x).
//
// pairs[b][h] is codes[nibble(b, h)]: the value of each half of a byte of
// codes, so that the CUDA kernels decode a code from its byte with one
// byte permute and one table read (dequantize4_byte), where its nibble would take
// a shift and a mask more.
struct QuantTable4 {
  using Buckets = Quant4Buckets;
  float codes[16];
  float midpoints[16];
  uint8_t start[2 * Buckets::kCount];
  float pairs[256][2];
};

// exp_avg's table (the signed dynamic map) then exp_avg_sq's (the unsigned
// dynamic map without zero, DE-0).
struct QuantTables4 {
  QuantTable4 table[2];
};

// The index of the code nearest to x (x already scaled by its block's
// 1 / absmax): the number of decision points below x. A value exactly on a
// decision point takes the lower code; NaN (greater than nothing) gives 0.
// The definition is the binary search (quantize4_search); the bucketed count
// takes 2 table reads instead of 4 (quantize4; the CUDA kernels' form of it,
// cuda/low_bit_codecs.cuh),
// and the CPU loops by 15 comparisons (quantize4_count), which have no
// branch and no data-dependent index, so that they vectorize (the search's
// compares became branches there, a mispredicted one per step).
GRADKIT_HD uint8_t quantize4_search(const QuantTable4& t, float x) { return count_below(t.midpoints, x); }
GRADKIT_HD uint8_t quantize4(const QuantTable4& t, float x) { return static_cast<uint8_t>(bucketed_count(t, x)); }
inline uint8_t quantize4_count(const QuantTable4& t, float x) {
  int q = 0;
  for (int i = 0; i < 15; ++i) q += x > t.midpoints[i] ? 1 : 0;
  return static_cast<uint8_t>(q);
}

GRADKIT_HD float dequantize4(const QuantTable4& t, uint32_t q, float absmax) { return exact::mul(t.codes[q], absmax); }

// dequantize4 of half h (0: the low nibble) of a byte of codes.
GRADKIT_HD float dequantize4_byte(const QuantTable4& t, uint32_t byte, int h, float absmax) {
  return exact::mul(t.pairs[byte][h], absmax);
}

// Two codes a byte: element 2k in the low nibble, element 2k + 1 in the high.
GRADKIT_HD uint8_t nibble(uint8_t byte, int64_t element) {
  return static_cast<uint8_t>((element & 1) != 0 ? byte >> 4 : byte & 0x0f);
}
GRADKIT_HD uint8_t pack_nibbles(uint8_t low, uint8_t high) { return static_cast<uint8_t>(low | (high << 4)); }

// Element i's code in a tensor's packed codes.
GRADKIT_HD uint8_t code4_at(const uint8_t* q, int64_t i) { return nibble(q[i / 2], i); }

// A block's n codes (one a byte, as encode_block4 gives them) stored two a
// byte from element `base` (even: a block starts on a byte); an odd block's
// last high nibble is 0.
inline void store_block4(const uint8_t* codes, int n, uint8_t* q, int64_t base) {
  for (int k = 0; k < n; k += 2) q[(base + k) / 2] = pack_nibbles(codes[k], k + 1 < n ? codes[k + 1] : 0);
}

// Encodes the block's n values (n <= kQuant4Block) into codes[0 .. n), one
// code a byte (the caller packs them), and returns the absmax.
inline float encode_block4(const QuantTable4& table, const float* values, int n, uint8_t* codes) {
  uint32_t top = 0;
  for (int i = 0; i < n; ++i) top = absmax_bits_fold(top, magnitude_bits(values[i]));
  const float amax = bits_float(top);
  const float scale = quant_scale(amax);
  for (int i = 0; i < n; ++i) codes[i] = quantize4_count(table, exact::mul(values[i], scale));
  return amax;
}

}  // namespace gradkit::spec
