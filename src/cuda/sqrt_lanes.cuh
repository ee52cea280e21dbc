// The correctly rounded square roots of a lane's values with one range test
// for all of them. The compiler's sqrt (sqrt.rn.f32) is a reciprocal square
// root, two products and two fused multiply-adds when its input lies in a
// range (a positive normal number from 2^-101 up, not Inf), a call
// otherwise, and it tests the range and branches for each value: eleven
// instructions a value, of which the branch, its reconvergence and a copy
// are six. Here the values' range tests fold into one maximum (one
// instruction a value) and one branch, to the same sequence for every value
// or to sqrt.rn for every value: the same bits either way
// (tests/test_sqrt_lanes.cu checks every f32 in the range against sqrt.rn).
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

// root[k] = sqrt(x[k]) correctly rounded, for N values.
template <int N>
__device__ __forceinline__ void sqrt_lane(const float (&x)[N], float (&root)[N]) {
  uint32_t widest = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) widest = max(widest, __float_as_uint(x[k]) + kSqrtRangeShift);
  if (widest <= kSqrtRangeTop) {
#pragma unroll
    for (int k = 0; k < N; ++k) root[k] = sqrt_fast_sequence(x[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) root[k] = __fsqrt_rn(x[k]);
  }
}

}  // namespace gradkit::cuda
