// The host copy of the 8-bit code tables the kernels read (built once, in
// src/ops/low_bit.cc), and the encode of one block that the CPU kernel and
// the whole-tensor quantize_blockwise share.
#pragma once

#include <cstdint>

#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_int8_math.h"

namespace gradkit::spec {

const QuantTables& quant_tables();
const QuantTables4& quant_tables4();

// Encodes the block's n values (n <= kQuantBlock): its absmax, then each
// value's code. Inline, so that each instruction-set copy of the CPU kernel
// (src/cpu/isa.h) has its own vector loops: the absmax is an integer max
// (absmax_bits_fold) and quantize has no branch, so both vectorize.
inline void encode_block(const QuantTable& table, const float* values, int n, uint8_t* codes, float* absmax) {
  uint32_t top = 0;
  for (int i = 0; i < n; ++i) top = absmax_bits_fold(top, magnitude_bits(values[i]));
  const float amax = bits_float(top);
  const float scale = quant_scale(amax);
  for (int i = 0; i < n; ++i) codes[i] = quantize(table, exact::mul(values[i], scale));
  *absmax = amax;
}

}  // namespace gradkit::spec
