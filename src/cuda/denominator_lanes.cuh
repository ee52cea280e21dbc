// The low-bit Adam's denominators (spec/adam_math.h, the folded form),
// 1 / (sqrt(v) + eps) for a lane's values, correctly rounded at each step,
// with one range test for all of them.
//
// The compiler's sqrt.rn.f32 is a reciprocal square root, two products and
// two fused multiply-adds when its input lies in a range (a positive normal
// number from 2^-101 up, not Inf), a call otherwise; its rcp.rn.f32 is an
// approximate reciprocal and one refinement when its input's exponent lies
// in a range, a call otherwise; each tests its range and branches for each
// value. Here the square roots' range tests fold into one maximum (one
// instruction a value) and one branch. A root from the fast sequence lies in
// [2^-50.5, 2^64), so with eps in [0, 2^64] the sum lies in the
// reciprocal's range and needs no test of its own. A lane that passes takes
// the two fast sequences on every value, one that fails the correctly
// rounded operations on every value: the same bits either way
// (tests/test_denominator_lanes.cu checks every f32 in each sequence's range
// against the compiler's operation).
#pragma once

#include <cstdint>

namespace gradkit::cuda {

// x's bits plus this, as an unsigned number, is at most kSqrtRangeTop exactly
// when x lies in the fast sequence's range ([2^-101, FLT_MAX], +0 and
// negative numbers, Inf and NaN outside): the compiler's own test.
inline constexpr uint32_t kSqrtRangeShift = 0xf3000000u;
inline constexpr uint32_t kSqrtRangeTop = 0x727fffffu;

__device__ __forceinline__ bool sqrt_in_range(float x) {
  return __float_as_uint(x) + kSqrtRangeShift <= kSqrtRangeTop;
}

// sqrt.rn's result for x in range, as sqrt.rn computes it there: r ~
// 1/sqrt(x), s = x r, the residual x - s^2 fused, and s corrected by it
// times r / 2.
__device__ __forceinline__ float sqrt_fast_sequence(float x) {
  float root;
  asm("{\n\t"
      ".reg .f32 r, s, h, e, n;\n\t"
      "rsqrt.approx.ftz.f32 r, %1;\n\t"
      "mul.ftz.f32 s, %1, r;\n\t"
      "mul.ftz.f32 h, r, 0f3F000000;\n\t"
      "neg.f32 n, s;\n\t"
      "fma.rn.f32 e, n, s, %1;\n\t"
      "fma.rn.f32 %0, e, h, s;\n\t"
      "}"
      : "=f"(root)
      : "f"(x));
  return root;
}

// Whether rcp.rn takes its fast sequence for x: x's exponent field in
// [1, 252] (|x| in [2^-126, 2^126)), the compiler's own test.
__device__ __forceinline__ bool reciprocal_in_range(float x) {
  const uint32_t exponent = (__float_as_uint(x) >> 23) & 0xffu;
  return exponent >= 1u && exponent <= 252u;
}

// rcp.rn's result for x in range, as rcp.rn computes it there: r ~ 1/x,
// then r corrected by its residual 1 - x r, fused.
__device__ __forceinline__ float reciprocal_fast_sequence(float x) {
  float reciprocal;
  asm("{\n\t"
      ".reg .f32 r, e, n;\n\t"
      "rcp.approx.ftz.f32 r, %1;\n\t"
      "neg.f32 n, %1;\n\t"
      "fma.rn.f32 e, n, r, 0f3F800000;\n\t"
      "fma.rn.f32 %0, r, e, r;\n\t"
      "}"
      : "=f"(reciprocal)
      : "f"(x));
  return reciprocal;
}

// The largest eps (as bits) for which every fast root plus eps lies in the
// reciprocal's range: eps in [+0, 2^64] (a NaN, -0 and a negative eps lie
// outside, and take the correctly rounded operations).
inline constexpr uint32_t kDenominatorEpsTop = 0x5f800000u;  // 2^64

// reciprocal[k] = 1 / (sqrt(v[k]) + eps), each operation correctly rounded,
// for N values: spec::folded_denominator_reciprocal on each.
template <int N>
__device__ __forceinline__ void denominator_reciprocal_lane(const float (&v)[N], float eps,
                                                            float (&reciprocal)[N]) {
  uint32_t widest = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) widest = max(widest, __float_as_uint(v[k]) + kSqrtRangeShift);
  if (widest <= kSqrtRangeTop && __float_as_uint(eps) <= kDenominatorEpsTop) {
#pragma unroll
    for (int k = 0; k < N; ++k) reciprocal[k] = reciprocal_fast_sequence(__fadd_rn(sqrt_fast_sequence(v[k]), eps));
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) reciprocal[k] = __frcp_rn(__fadd_rn(__fsqrt_rn(v[k]), eps));
  }
}

}  // namespace gradkit::cuda
