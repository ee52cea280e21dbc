// The 16-bit conversions against an independent rule: the nearest of all
// finite values of the format (found by search over every bit pattern), ties
// to the even pattern, overflow to Inf past the rounding boundary.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gradkit/core/dtype.h"

namespace gradkit {
namespace {

struct Table {
  std::vector<std::pair<double, uint16_t>> finite;  // sorted by value, +0 only
  double max_finite;
  double next_after_max;  // the value the next exponent would give (overflow boundary is the midpoint)
};

template <class T>
Table make_table(double next_after_max) {
  Table t;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = static_cast<float>(T::from_bits(static_cast<uint16_t>(b)));
    if (!std::isfinite(f) || b == 0x8000) continue;
    t.finite.emplace_back(f, static_cast<uint16_t>(b));
  }
  std::sort(t.finite.begin(), t.finite.end());
  t.max_finite = t.finite.back().first;
  t.next_after_max = next_after_max;
  return t;
}

uint16_t nearest_even(const Table& t, double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::abs(x);
  if (a >= (t.max_finite + t.next_after_max) / 2) return sign | (t.finite.back().second + 1);  // Inf pattern
  auto hi = std::lower_bound(t.finite.begin(), t.finite.end(), std::make_pair(a, uint16_t{0}));
  if (hi == t.finite.begin()) return sign | hi->second;
  auto lo = hi - 1;
  if (hi == t.finite.end()) return sign | lo->second;
  const double dlo = a - lo->first, dhi = hi->first - a;
  uint16_t bits;
  if (dlo < dhi) bits = lo->second;
  else if (dhi < dlo) bits = hi->second;
  else bits = (lo->second % 2 == 0) ? lo->second : hi->second;
  if (bits == 0) return sign;  // signed zero keeps its sign
  return sign | bits;
}

template <class T>
void check_conversion(const Table& table, uint32_t (*make_bits)(std::mt19937&)) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 400000; ++i) {
    const float x = std::bit_cast<float>(make_bits(rng));
    if (!std::isfinite(x)) continue;
    const uint16_t want = nearest_even(table, x);
    ASSERT_EQ(T(x).bits, want) << "x=" << x << " bits=" << std::bit_cast<uint32_t>(x);
  }
}

TEST(DType, HalfRoundTripsEveryFiniteValue) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const half h = half::from_bits(static_cast<uint16_t>(b));
    const float f = static_cast<float>(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(half(f))));
      continue;
    }
    EXPECT_EQ(half(f).bits, b) << b;
  }
}

TEST(DType, Bfloat16RoundTripsEveryFiniteValue) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const bfloat16 h = bfloat16::from_bits(static_cast<uint16_t>(b));
    const float f = static_cast<float>(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(bfloat16(f))));
      continue;
    }
    EXPECT_EQ(bfloat16(f).bits, b) << b;
  }
}

// Random floats in the half range (exponents around [-30, 17]) and across all floats.
uint32_t half_range_bits(std::mt19937& rng) {
  const uint32_t exponent = 97 + rng() % 48;
  return (rng() & 0x80000000u) | (exponent << 23) | (rng() & 0x7fffffu);
}
uint32_t any_bits(std::mt19937& rng) { return rng(); }

TEST(DType, HalfRoundsToNearestEven) {
  const Table table = make_table<half>(65536.0);
  check_conversion<half>(table, half_range_bits);
  check_conversion<half>(table, any_bits);
  // Ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 -> even (1).
  EXPECT_EQ(half(1.0f + 0x1p-11f).bits, 0x3c00);
  EXPECT_EQ(half(1.0f + 3 * 0x1p-11f).bits, 0x3c02);
  EXPECT_EQ(half(65519.0f).bits, 0x7bff);
  EXPECT_EQ(half(65520.0f).bits, 0x7c00);
  EXPECT_EQ(half(0x1p-25f).bits, 0x0000);  // tie between 0 and the smallest subnormal -> 0
  EXPECT_EQ(half(0x1.8p-25f).bits, 0x0001);
}

TEST(DType, Bfloat16RoundsToNearestEven) {
  const Table table = make_table<bfloat16>(0x1p128);
  check_conversion<bfloat16>(table, any_bits);
  EXPECT_EQ(bfloat16(1.0f + 0x1p-8f).bits, 0x3f80);
  EXPECT_EQ(bfloat16(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
}

TEST(DType, NonFiniteValuesStayNonFinite) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(half(inf).bits, 0x7c00);
  EXPECT_EQ(half(-inf).bits, 0xfc00);
  EXPECT_TRUE(std::isnan(static_cast<float>(half(nan))));
  EXPECT_EQ(bfloat16(inf).bits, 0x7f80);
  EXPECT_TRUE(std::isnan(static_cast<float>(bfloat16(nan))));
  // A signalling NaN whose payload sits in the dropped bits must not become Inf.
  EXPECT_TRUE(std::isnan(static_cast<float>(bfloat16(std::bit_cast<float>(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(static_cast<float>(half(std::bit_cast<float>(0x7f800001u)))));
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
}

}  // namespace
}  // namespace gradkit
