// LAMB with 8- or 4-bit blockwise moments: the pieces both backends share, so
// that the CPU and CUDA steps are the same bit for bit (the CUDA kernels call
// the per-element forms below; the CPU decodes a block into floats, then
// calls the same lamb_moments_folded, lamb_direction_folded and
// lamb_low_bit_apply: the low-bit form of spec/lamb_math.h). The moments are
// decoded, updated and encoded with adam_step's code (spec/low_bit_int8_math.h,
// low_bit_int4_math.h; `Tables` is QuantTables or QuantTables4); the
// direction d that the norms and pass 2 use is computed from the encoded
// (stored) moments, as the f32 path computes it from the rounded ones.
//
// The non-finite rule works on whole blocks: a block is encoded as a whole
// (one absmax), so one element cannot keep its old moments while the rest
// of its block takes new ones. Where d is not finite for any element of a
// block, pass 1 leaves the block's codes and absmax as they were, adds none
// of its d^2, and marks it by flipping the sign of its exp_avg absmax (never
// negative otherwise); pass 2 flips it back and leaves the block's weights.
// So no Inf or NaN ever reaches the stored moments.
#pragma once

#include <cstdint>

#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_int8_math.h"
#include "spec/lamb_math.h"
#include "spec/master_math.h"  // float_bits

namespace gradkit::spec {

// The CUDA kernels give each quantization block kLaneElements elements per
// lane, lane k elements [k * kLaneElements, (k + 1) * kLaneElements): a warp
// owns an 8-bit block, a half-warp a 4-bit one. The CPU walks a block in the
// same pieces, so that the sums of squares are added in the same order.
constexpr int kWarpLanes = 32;
constexpr int kLaneElements = kQuantBlock / kWarpLanes;
static_assert(kQuantBlock % kWarpLanes == 0 && kQuant4Block % kLaneElements == 0);

// The value lane 0 holds after a tree over `Lanes` lanes' values (shuffles by
// Lanes / 2, ..., 2, 1, down or xor: lane 0 adds lane offset either way).
template <int Lanes>
inline double warp_tree_sum(double (&lanes)[Lanes]) {
  for (int offset = Lanes / 2; offset > 0; offset /= 2) {
    for (int i = 0; i < offset; ++i) lanes[i] = lanes[i] + lanes[i + offset];
  }
  return lanes[0];
}

// values[0], values[stride], ... (count of them) added as the ratio kernel
// of src/cuda/lamb.cu adds a tensor's chunk partials: lane k takes k,
// k + 32, ... in order, then the warp's tree.
inline double lane_strided_sum(const double* values, int64_t count, int64_t stride) {
  double lanes[kWarpLanes] = {};
  for (int64_t i = 0; i < count; ++i) lanes[i % kWarpLanes] += values[i * stride];
  return warp_tree_sum(lanes);
}

// A code's value in either form (q below 256, in any unsigned width, as
// dequantize takes it: the CUDA kernels pass it as they take it from a word).
GRADKIT_HD float decoded(const QuantTable& t, uint32_t q, float absmax) { return dequantize(t, q, absmax); }
GRADKIT_HD float decoded(const QuantTable4& t, uint32_t q, float absmax) { return dequantize4(t, q, absmax); }

// One element's moments after the step, from its codes (pass 1), in the
// low-bit form (lamb_moments_folded). The direction then comes from the
// stored moments (lamb_direction_folded), the reciprocal per element on the
// CPU and a lane's at once on CUDA (cuda/denominator_lanes.cuh).
template <class Tables>
GRADKIT_HD void lamb_blockwise_moments(float g, uint32_t qm, uint32_t qv, float absmax_m, float absmax_v,
                                       const Tables& t, const LambCoefficients<float>& c, float& m, float& v) {
  m = decoded(t.table[0], qm, absmax_m);
  v = decoded(t.table[1], qv, absmax_v);
  lamb_moments_folded(g, m, v, c);
}

// The block mark (see above): set by pass 1, cleared by pass 2; both flip.
GRADKIT_HD float lamb_flip_mark(float absmax) { return -absmax; }
GRADKIT_HD bool lamb_marked(float absmax) { return (float_bits(absmax) >> 31) != 0; }

// Pass 2 for an element of an unmarked block, from its direction d: the new
// weight, or the old one where the new one would not be finite.
GRADKIT_HD float lamb_low_bit_apply(float w, float step, float d) {
  const float updated = lamb_apply(w, step, d);
  return finite(updated) ? updated : w;
}

}  // namespace gradkit::spec
