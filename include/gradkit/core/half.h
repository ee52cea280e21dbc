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

inline uint16_t float_to_half_bits(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // Inf stays Inf; NaN becomes a quiet NaN.
    return static_cast<uint16_t>(sign | (magnitude > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (magnitude >= 0x477ff000u) {  // |value| >= 65520 rounds to Inf.
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (magnitude < 0x38800000u) {  // Below 2^-14: a half subnormal (or zero).
    // Adding 0.5f puts the half subnormal grid (spacing 2^-24) at the float's
    // last mantissa bit, so the FPU performs the round-to-nearest-even for us.
    const float shifted = std::bit_cast<float>(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
  const uint32_t odd = (magnitude >> 13) & 1u;
  magnitude += 0xc8000fffu + odd;
  return static_cast<uint16_t>(sign | (magnitude >> 13));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_bfloat16_bits(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
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
