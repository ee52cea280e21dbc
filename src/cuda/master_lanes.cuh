// The remainder master (spec/master_math.h) over a lane's kPerLane
// values, its bf16 weights and 16-bit remainders held as the words memory
// has them (cuda/low_bit_lanes.cuh, LaneBits): the same values as
// join_master and split_master on each, in fewer instructions than unpacking
// each half into a register of its own.
#pragma once

#include <cstdint>

#include "spec/master_math.h"
#include "cuda/low_bit_lanes.cuh"

namespace gradkit::cuda {

using Halves = LaneBits<16>;

// join_master on each value: the compiler takes a high half in place (a
// mask) and a low one with a shift, so that each master is two or three
// integer operations.
__device__ __forceinline__ void join_lane(const Halves& weights, const Halves& remainders,
                                          float (&master)[kPerLane]) {
#pragma unroll
  for (int j = 0; j < Halves::kWords; ++j) {
    const uint32_t w = weights.word[j], r = remainders.word[j];
    master[2 * j] = spec::join_master(static_cast<uint16_t>(w), static_cast<int16_t>(r));
    master[2 * j + 1] = spec::join_master(static_cast<uint16_t>(w >> 16), static_cast<int16_t>(r >> 16));
  }
}

// split_master on each value. When no master of the lane is a NaN (a
// compare each), a pair's weights are the top halves of its two
// rounded_weight_bits and its remainders the masters' low halves (one byte
// permute each: split_master's remainder is the master's low 16 bits);
// otherwise (rare: a NaN in the step) split_master on each value.
__device__ __forceinline__ void split_lane(const float (&master)[kPerLane], Halves& weights, Halves& remainders) {
  bool any_nan = false;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) any_nan = any_nan || master[k] != master[k];
  if (!any_nan) {
#pragma unroll
    for (int j = 0; j < Halves::kWords; ++j) {
      const uint32_t low = spec::float_bits(master[2 * j]), high = spec::float_bits(master[2 * j + 1]);
      weights.word[j] = __byte_perm(spec::rounded_weight_bits(low), spec::rounded_weight_bits(high), 0x7632);
      remainders.word[j] = __byte_perm(low, high, 0x5410);
    }
    return;
  }
  uint32_t w[kPerLane], r[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    uint16_t weight;
    int16_t remainder;
    spec::split_master(master[k], weight, remainder);
    w[k] = weight;
    r[k] = static_cast<uint16_t>(remainder);
  }
  weights = Halves::pack(w);
  remainders = Halves::pack(r);
}

}  // namespace gradkit::cuda
