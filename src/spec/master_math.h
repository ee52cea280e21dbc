// An f32 master weight kept as a bf16 weight plus a 16-bit remainder, written
// once for both backends. The weight is the master rounded to nearest, ties
// away from zero (in the magnitude); the remainder is the master's bit
// pattern minus the weight's (shifted up 16 bits), a signed 16-bit integer in
// [-32768, 32767]. Together they give the master back bit for bit, for every
// value but NaN, which stays a NaN (docs/ops.md, "the remainder master").
//
// Why ties away from zero, not to even: a bf16 weight w has 65536 f32 values
// that round to it under this rule (low halves 0x8000 below to 0x7fff above),
// exactly the 65536 remainders 16 bits hold; under ties-to-even an even
// weight would have 65537 and an odd one 65535, and one remainder would have
// to stand for two masters.
#pragma once

#include <cstdint>

#include "spec/exact_math.h"

#include <cstring>

namespace gradkit::spec {

// The bit pattern of x as a `To` of the same size (std::bit_cast, which
// device code cannot call): memcpy, which both compilers turn into a move.
template <class To, class From>
GRADKIT_HD To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  memcpy(&y, &x, sizeof y);
  return y;
}

GRADKIT_HD uint32_t float_bits(float x) { return bits_as<uint32_t>(x); }
GRADKIT_HD float bits_float(uint32_t bits) { return bits_as<float>(bits); }

// The bf16 weight's bits and the remainder for `master`. Integer arithmetic
// on the bit pattern rounds the magnitude (the sign bit never changes: the
// magnitude rounds at most to 0x7f80 << 16, Inf); a value past bf16's
// largest finite one rounds to Inf, as any conversion to nearest does, and
// its remainder still holds the master. A NaN master gives a quiet NaN weight
// (its top 16 bits with the quiet bit set) and its low 16 bits.
//
// rounded_weight_bits gives, in its top 16 bits, the weight of a master that
// is not a NaN (the CUDA kernels take two at a time from there: cuda/
// master_lanes.cuh).
GRADKIT_HD uint32_t rounded_weight_bits(uint32_t master_bits) { return master_bits + 0x8000u; }

GRADKIT_HD void split_master(float master, uint16_t& weight, int16_t& remainder) {
  const uint32_t bits = float_bits(master);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  // Selects, not branches, so that a CPU loop over elements vectorizes.
  weight = nan ? static_cast<uint16_t>((bits >> 16) | 0x40u) : static_cast<uint16_t>(rounded_weight_bits(bits) >> 16);
  // The weight's bits end in 16 zeros, so the remainder is the master's low
  // 16 bits in both cases.
  remainder = static_cast<int16_t>(static_cast<uint16_t>(bits - (static_cast<uint32_t>(weight) << 16)));
}

// The master from its weight and remainder: the inverse of split_master.
// One integer add, with no rule for NaN: a NaN weight (its exponent all
// ones, its fraction at least the quiet bit when split_master wrote it, and
// nonzero in any case) plus any remainder in [-32768, 32767] keeps its
// exponent and a nonzero fraction, so it joins to a NaN (not always quiet:
// a negative remainder may clear the quiet bit; the next split quiets it
// again). An Inf weight with a negative remainder gives the finite master it
// was split from.
GRADKIT_HD float join_master(uint16_t weight, int16_t remainder) {
  return bits_float((static_cast<uint32_t>(weight) << 16) + static_cast<uint32_t>(static_cast<int32_t>(remainder)));
}

}  // namespace gradkit::spec
