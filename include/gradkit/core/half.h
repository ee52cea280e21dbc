// Host-side storage types for the two 16-bit floating-point formats.
//
// Conversions from float round to nearest, ties to even, exactly as the CUDA
// intrinsics __float2half_rn and __float2bfloat16_rn do, so that a CPU result
// and a CUDA result computed in f32 and rounded once are bitwise equal.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace gradkit {

namespace detail {

// The conversions are written without branches: each case's result is
// computed and the right one taken with an integer mask, so that a loop over
// them (the CPU kernels' loads and stores of f16/bf16 tensors) has no control
// flow and vectorizes (docs/cpu-kernels.md). (A `?:` between the cases is
// not enough: GCC sinks a case's float work under a branch again.) Every
// case gives the branching form's result for every input; tests/test_dtype.cc
// checks them against references.

// All ones where `condition`, else zero.
inline uint32_t mask_if(bool condition) { return 0u - static_cast<uint32_t>(condition); }

// a where `mask` is all ones, b where it is zero.
inline uint32_t masked_select(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }

inline uint16_t float_to_half_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  // Inf stays Inf; NaN becomes a quiet NaN.
  const uint32_t special = masked_select(mask_if(magnitude > 0x7f800000u), 0x7e00u, 0x7c00u);
  // Below 2^-14: a half subnormal (or zero). Adding 0.5f puts the half
  // subnormal grid (spacing 2^-24) at the float's last mantissa bit, so the
  // FPU performs the round-to-nearest-even for us.
  const uint32_t subnormal = std::bit_cast<uint32_t>(std::bit_cast<float>(magnitude) + 0.5f) - 0x3f000000u;
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
  const uint32_t normal = (magnitude + 0xc8000fffu + ((magnitude >> 13) & 1u)) >> 13;
  uint32_t out = masked_select(mask_if(magnitude < 0x38800000u), subnormal, normal);
  out = masked_select(mask_if(magnitude >= 0x477ff000u), 0x7c00u, out);  // |value| >= 65520 rounds to Inf
  out = masked_select(mask_if(magnitude >= 0x7f800000u), special, out);
  return static_cast<uint16_t>(sign | (out & 0xffffu));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  // Zero or subnormal: mantissa * 2^-24, exact in float (and >= 0, so the sign is or-ed in).
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 5.9604644775390625e-8f);
  const uint32_t special = 0x7f800000u | (mantissa << 13);
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  const uint32_t out =
      masked_select(mask_if(exponent == 0), subnormal, masked_select(mask_if(exponent == 31), special, normal));
  return std::bit_cast<float>(sign | out);
}

inline uint16_t float_to_bfloat16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t nan = (bits >> 16) | 0x40u;  // a NaN keeps its top bits, made quiet
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(masked_select(mask_if((bits & 0x7fffffffu) > 0x7f800000u), nan, rounded));
}

inline float bfloat16_bits_to_float(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

}  // namespace detail

// IEEE 754 binary16. Layout-compatible with CUDA's __half.
struct half {
  uint16_t bits = 0;
  half() = default;
  explicit half(float v) : bits(detail::float_to_half_bits(v)) {}
  explicit operator float() const { return detail::half_bits_to_float(bits); }
  static half from_bits(uint16_t b) { half h; h.bits = b; return h; }
};

// bfloat16: the upper half of an IEEE binary32. Layout-compatible with __nv_bfloat16.
struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  explicit bfloat16(float v) : bits(detail::float_to_bfloat16_bits(v)) {}
  explicit operator float() const { return detail::bfloat16_bits_to_float(bits); }
  static bfloat16 from_bits(uint16_t b) { bfloat16 h; h.bits = b; return h; }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2);

}  // namespace gradkit
