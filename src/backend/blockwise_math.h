// The encode and decode of 8-bit blockwise moments (include/gradkit/ops/
// blockwise.h), written once and compiled for both backends, so that the CPU
// and CUDA kernels store the same byte for the same value.
#pragma once

#include <cstdint>

#include "backend/exact_math.h"
#include "gradkit/ops/blockwise.h"

namespace gradkit::backend {

// One code table as the kernels read it: the 256 codes, ascending, and the
// 255 decision points between neighbours (midpoints[i] between codes i and
// i + 1, the f64 midpoint rounded to f32 once, on the host).
struct QuantTable {
  float codes[256];
  float midpoints[256];  // 255 used; the last is +Inf, never read
  // The lowest code a positive value may take: 1 for the unsigned map (a
  // positive exp_avg_sq never encodes as 0: docs/ops.md), 0 (no floor) for
  // the signed one.
  int32_t positive_floor;
};

// Both tables, exp_avg's (signed) then exp_avg_sq's (unsigned).
struct QuantTables {
  QuantTable table[2];
};

// A block's absolute maximum, folded one value at a time: a NaN anywhere
// makes it NaN (a plain max would drop it), so a non-finite moment is not
// hidden by its block's encoding. The result does not depend on the order.
GRADKIT_HD float absmax_fold(float absmax, float x) {
  const float magnitude = x < 0 ? -x : x;
  if (absmax != absmax) return absmax;
  if (magnitude != magnitude) return magnitude;
  return magnitude > absmax ? magnitude : absmax;
}

// The multiplier that maps a block onto [-1, 1]: 1 / absmax, or 0 for an
// all-zero block (every value then encodes as the code 0). An Inf absmax
// gives 0 too, a NaN absmax NaN: the block decodes to Inf/NaN either way.
GRADKIT_HD float quant_scale(float absmax) { return absmax == 0.0f ? 0.0f : 1.0f / absmax; }

// The index of the code nearest to x (x already scaled into [-1, 1]): the
// number of decision points below x, found by a branch-free binary search.
// A value exactly on a decision point takes the lower code; a positive value
// takes at least the table's positive_floor. NaN gives 0.
GRADKIT_HD uint8_t quantize(const QuantTable& t, float x) {
  int q = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int step = 128; step > 0; step >>= 1) q += x > t.midpoints[q + step - 1] ? step : 0;
  q = x > 0.0f && q < t.positive_floor ? t.positive_floor : q;
  return static_cast<uint8_t>(q);
}

GRADKIT_HD float dequantize(const QuantTable& t, uint8_t q, float absmax) { return exact::mul(t.codes[q], absmax); }

}  // namespace gradkit::backend
