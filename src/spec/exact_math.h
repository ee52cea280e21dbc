// Arithmetic that both backends round the same way: each operation rounded
// once, never fused into a multiply-add. The CUDA compiler fuses a * b + c
// unless told not to (the _rn intrinsics); host code is compiled with
// -ffp-contract=off (src/CMakeLists.txt). Kernels whose results must be the
// same bit for bit on the CPU and on CUDA (the encoded optimizer state,
// where one rounding apart can be one code apart) compute with these.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define GRADKIT_HD __host__ __device__ __forceinline__
#else
#define GRADKIT_HD inline
#endif

namespace gradkit::spec::exact {

#if defined(__CUDA_ARCH__)
GRADKIT_HD float mul(float a, float b) { return __fmul_rn(a, b); }
GRADKIT_HD float add(float a, float b) { return __fadd_rn(a, b); }
GRADKIT_HD float sub(float a, float b) { return __fsub_rn(a, b); }
GRADKIT_HD double mul(double a, double b) { return __dmul_rn(a, b); }
GRADKIT_HD double add(double a, double b) { return __dadd_rn(a, b); }
GRADKIT_HD double sub(double a, double b) { return __dsub_rn(a, b); }
#else
GRADKIT_HD float mul(float a, float b) { return a * b; }
GRADKIT_HD float add(float a, float b) { return a + b; }
GRADKIT_HD float sub(float a, float b) { return a - b; }
GRADKIT_HD double mul(double a, double b) { return a * b; }
GRADKIT_HD double add(double a, double b) { return a + b; }
GRADKIT_HD double sub(double a, double b) { return a - b; }
#endif

// a * b + c rounded once (IEEE fusedMultiplyAdd): one FFMA on CUDA, std::fma
// on the host (an FMA instruction in the AVX2 and AVX-512 copies of the CPU
// kernels, src/cpu/isa.h; libm's correctly rounded fmaf in the baseline
// copy), so both backends give the same bits. Only for formulas written with
// it (the low-bit moments' folded form): a plain a * b + c stays two roundings.
#if defined(__CUDA_ARCH__)
GRADKIT_HD float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
GRADKIT_HD double fma(double a, double b, double c) { return __fma_rn(a, b, c); }
#else
GRADKIT_HD float fma(float a, float b, float c) { return std::fma(a, b, c); }
GRADKIT_HD double fma(double a, double b, double c) { return std::fma(a, b, c); }
#endif

// a / b correctly rounded (IEEE division), whatever the compiler's flags.
#if defined(__CUDA_ARCH__)
GRADKIT_HD float div(float a, float b) { return __fdiv_rn(a, b); }
#else
GRADKIT_HD float div(float a, float b) { return a / b; }
#endif

// 1 / x correctly rounded (IEEE division of 1 by x), as one operation:
// __frcp_rn on CUDA (a reciprocal, its refinement, a range check and a
// slow-path branch; cuda/denominator_lanes.cuh takes a lane's under one test).
#if defined(__CUDA_ARCH__)
GRADKIT_HD float reciprocal(float x) { return __frcp_rn(x); }
GRADKIT_HD double reciprocal(double x) { return __drcp_rn(x); }
#else
GRADKIT_HD float reciprocal(float x) { return 1.0f / x; }
GRADKIT_HD double reciprocal(double x) { return 1.0 / x; }
#endif

// -x, as a flip of the sign bit that no compiler folds away. Host compilers
// rewrite (-x) + y as y - x, which is the same number for every x but a
// NaN, whose sign the flip changes and the subtraction keeps; CUDA's
// negation is the flip itself (and its _rn operations are never rewritten).
#if defined(__CUDA_ARCH__)
GRADKIT_HD float neg(float x) { return -x; }
GRADKIT_HD double neg(double x) { return -x; }
#else
GRADKIT_HD float neg(float x) { return std::bit_cast<float>(std::bit_cast<uint32_t>(x) ^ 0x80000000u); }
GRADKIT_HD double neg(double x) { return std::bit_cast<double>(std::bit_cast<uint64_t>(x) ^ 0x8000000000000000ull); }
#endif

// x^n for n >= 0 by repeated squaring: the same roundings on every backend
// (the libraries' pow functions may differ in the last bit).
GRADKIT_HD double power(double x, long long n) {
  double result = 1.0;
  while (n > 0) {
    if (n & 1) result = mul(result, x);
    x = mul(x, x);
    n >>= 1;
  }
  return result;
}

}  // namespace gradkit::spec::exact
