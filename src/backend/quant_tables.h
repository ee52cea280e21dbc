// The host copy of the 8-bit code tables the kernels read (built once, in
// src/ops/blockwise.cc), and the encode of one block that the CPU kernel and
// the whole-tensor quantize_blockwise share.
#pragma once

#include <cstdint>

#include "backend/blockwise_math.h"
#include "backend/master_math.h"  // float_bits, bits_float

namespace gradkit::backend {

const QuantTables& quant_tables();

// Encodes the block's n values (n <= kQuantBlock): its absmax, then each
// value's code. Inline, so that the CPU kernel's copy for each instruction
// set (src/cpu/isa.h) has its own vector loops. The absmax is first taken as
// the largest magnitude's bit pattern (for floats >= 0 the integer order is
// the numeric order, NaN above Inf; a max over integers vectorizes where one
// over floats, NaN-aware, does not): the same value absmax_fold gives, the
// same bits (absmax_fold's +0 start and its -0 magnitude of -0 included).
// Only a block with a NaN is folded again one value at a time, to keep
// absmax_fold's choice of NaN.
inline void encode_block(const QuantTable& table, const float* values, int n, uint8_t* codes, float* absmax) {
  uint32_t top = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t magnitude = float_bits(values[i]) & 0x7fffffffu;
    top = magnitude > top ? magnitude : top;
  }
  float amax = bits_float(top);
  if (top > 0x7f800000u) {
    amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = absmax_fold(amax, values[i]);
  }
  const float scale = quant_scale(amax);
  for (int i = 0; i < n; ++i) codes[i] = quantize(table, exact::mul(values[i], scale));
  *absmax = amax;
}

}  // namespace gradkit::backend
