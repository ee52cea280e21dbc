// The host copy of the 8-bit code tables the kernels read (built once, in
// src/ops/blockwise.cc), and the encode of one block that the CPU kernel and
// the whole-tensor quantize_blockwise share.
#pragma once

#include <cstdint>

#include "backend/blockwise_math.h"

namespace gradkit::backend {

const QuantTables& quant_tables();

// Encodes the block's n values (n <= kQuantBlock): its absmax, then each
// value's code.
void encode_block(const QuantTable& table, const float* values, int n, uint8_t* codes, float* absmax);

}  // namespace gradkit::backend
