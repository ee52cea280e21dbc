// The 8-bit code tables and blockwise quantize/dequantize against the
// float64 reference of tests/support/low_bit_reference.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "spec/low_bit_int8_math.h"
#include "spec/low_bit_tables.h"
#include "gradkit/ops/low_bit.h"
#include "support/low_bit_reference.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

const QuantCode kCodes[] = {QuantCode::signed_dynamic, QuantCode::unsigned_dynamic};

TEST(QuantCode, TablesAreThePapersDynamicMapsRoundedToF32) {
  for (QuantCode code : kCodes) {
    const bool is_signed = code == QuantCode::signed_dynamic;
    const std::vector<double> ref = reference_code(is_signed);
    ASSERT_EQ(ref.size(), 256u);
    const auto& got = quant_code(code);
    for (int i = 0; i < 256; ++i) EXPECT_EQ(got[i], static_cast<float>(ref[i])) << "code " << i;
    for (int i = 1; i < 256; ++i) EXPECT_LT(got[i - 1], got[i]) << "ascending and distinct at " << i;
    EXPECT_EQ(got[255], 1.0f);
    EXPECT_EQ(is_signed ? got[127] : got[0], 0.0f);
  }
  // The signed map is symmetric but for its +1 (it has no -1).
  const auto& s = quant_code(QuantCode::signed_dynamic);
  for (int i = 0; i < 127; ++i) EXPECT_EQ(s[i], -s[254 - i]);
}

TEST(QuantCode, RejectsAnUnknownCode) {
  expect_error([] { quant_code(static_cast<QuantCode>(2)); }, ErrorCode::invalid_argument, {"code", "signed_dynamic"});
}

struct Encoded {
  TestTensor codes, absmax;
};

Encoded encode(Device device, QuantCode code, const std::vector<double>& x) {
  TestTensor values(device, DType::f32, x);
  Encoded e{TestTensor(device, DType::u8, std::vector<double>(x.size(), 0.0)),
            TestTensor(device, DType::f32, std::vector<double>(quant_blocks(static_cast<int64_t>(x.size())), 0.0))};
  quantize_blockwise(code, values.view(), e.codes.view(), e.absmax.view());
  return e;
}

// The encoder's bucketed search (a start per range of f32 bit patterns, then
// a few comparisons) against the definition: the number of decision points
// (f64 midpoints of neighbouring codes, rounded to f32) below x, counted
// here with std::lower_bound, and at least 1 for a positive second moment. Every bucket edge and its neighbours, both
// signs, and a million values spread over every exponent in [-1, 1]. A 1.0
// opens each block so that the absmax is 1 and x is encoded as it is.
TEST(QuantCode, EncodingCountsTheDecisionPointsBelowEachValue) {
  std::vector<double> x;
  for (uint32_t bits = 0; bits <= 0x3F800000u; bits += 1u << 15) {  // every edge of buckets up to 8 fraction bits
    for (int64_t d = -2; d <= 2; ++d) {
      const int64_t b = static_cast<int64_t>(bits) + d;
      if (b < 0 || b > 0x3F800000) continue;
      const auto u = static_cast<uint32_t>(b);
      float f;
      std::memcpy(&f, &u, sizeof f);
      x.push_back(f);
      x.push_back(-f);
    }
  }
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<uint32_t> any_bits(0, 0x3F800000u);
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t u = any_bits(rng);
    float f;
    std::memcpy(&f, &u, sizeof f);
    x.push_back(i % 2 ? -f : f);
  }
  for (QuantCode code : kCodes) {
    const std::vector<double> table = reference_code(code == QuantCode::signed_dynamic);
    std::vector<float> midpoints(255);
    for (size_t i = 0; i < 255; ++i) midpoints[i] = static_cast<float>((table[i] + table[i + 1]) / 2);
    std::vector<double> blocks;
    std::vector<double> want;
    for (size_t i = 0; i < x.size(); ++i) {
      if (blocks.size() % kQuantBlock == 0) blocks.push_back(1.0), want.push_back(255);
      const auto v = static_cast<float>(code == QuantCode::unsigned_dynamic ? std::abs(x[i]) : x[i]);
      blocks.push_back(v);
      auto count = std::lower_bound(midpoints.begin(), midpoints.end(), v) - midpoints.begin();
      if (code == QuantCode::unsigned_dynamic && v > 0 && count == 0) count = 1;  // the positive floor (docs/ops.md)
      want.push_back(static_cast<double>(count));
    }
    const Encoded e = encode(Device::cpu(), code, blocks);
    const std::vector<double> got = e.codes.read();
    for (size_t i = 0; i < blocks.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "x = " << blocks[i] << " (" << (code == QuantCode::signed_dynamic ? "signed" : "unsigned") << ")";
    }
  }
}

// The unsigned table's decision points are all at least 0 (what the CUDA
// kernels' encode of the second moment relies on to count from the positive
// buckets only: cuda/low_bit_codecs.cuh, checked against bucketed_count on
// every f32 by test_low_bit_codecs_cuda), and the bucketed count gives the
// binary search's code for its values: the same values as above, both
// signs, -0, NaN of both signs and values past 1 (a rounding of v / absmax;
// no value the kernels encode reaches 2, and an Inf absmax scales by 0).
TEST(QuantCode, TheUnsignedTableCountsAsTheSearchOnBothSigns) {
  const spec::QuantTable& t = spec::quant_tables().table[1];
  for (int i = 0; i < 255; ++i) ASSERT_GE(t.midpoints[i], 0.0f) << "decision point " << i;
  std::vector<float> x = {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                          1.0f, 1.5f, std::nextafter(2.0f, 0.0f)};
  for (uint32_t bits = 0; bits <= 0x3F800000u; bits += 1u << 15) {
    for (uint32_t b = bits == 0 ? 0 : bits - 2; b <= bits + 2; ++b) x.push_back(spec::bits_float(b));
  }
  std::mt19937_64 rng(12);
  std::uniform_int_distribution<uint32_t> any_bits(0, 0x3FFFFFFFu);
  for (int i = 0; i < 1000000; ++i) x.push_back(spec::bits_float(any_bits(rng)));
  for (float v : {1.0f, -1.0f}) {
    for (float f : x) {
      const float y = v * f;
      const uint32_t want = spec::quantize_search(t, y);
      ASSERT_EQ(spec::bucketed_count(t, y), want) << "x = " << y;
    }
  }
}

using QuantizeBlockwise = OnEachDevice;

// Every value gets its block's absmax (exactly max |x|) and the code nearest
// to x / absmax; where the two nearest codes are within f32 rounding of a
// tie, either one. Blocks of every tensor size, the last one short.
TEST_P(QuantizeBlockwise, QuantizeTakesTheNearestCodeOfEachBlock) {
  std::mt19937_64 rng(7);
  for (QuantCode code : kCodes) {
    const std::vector<double> table = reference_code(code == QuantCode::signed_dynamic);
    for (int64_t n : {1, 255, 256, 257, 1000, 4096 + 5}) {
      std::vector<double> x = round_to(DType::f32, random_values(rng, n, 1e-3));
      // Moments span decades: scale each value by a random power of ten.
      std::uniform_int_distribution<int> decade(-6, 0);
      for (double& v : x) {
        v = static_cast<float>(v * std::pow(10.0, decade(rng)));
        if (code == QuantCode::unsigned_dynamic) v = std::abs(v);
      }
      const Encoded e = encode(device(), code, x);
      const std::vector<double> q = e.codes.read(), absmax = e.absmax.read();
      ASSERT_EQ(static_cast<int64_t>(absmax.size()), quant_blocks(n));
      for (int64_t i = 0; i < n; ++i) {
        const size_t b = static_cast<size_t>(i / kQuantBlock);
        const double want_absmax = block_absmax(x, b * kQuantBlock, std::min<size_t>(x.size(), (b + 1) * kQuantBlock));
        ASSERT_EQ(absmax[b], want_absmax) << "block " << b;
        const Nearest want = nearest_code(table, x[i] / want_absmax, code == QuantCode::unsigned_dynamic);
        const int got = static_cast<int>(q[i]);
        if (got != want.index) {
          // Only a near-tie may go the other way: the two distances agree to f32 rounding.
          EXPECT_LE(std::abs(std::abs(table[got] - x[i] / want_absmax) - want.distance), 0x1p-22)
              << "n " << n << " element " << i << ": code " << got << ", nearest " << want.index;
        }
      }
      // Decoding gives code * absmax, rounded to f32 once.
      TestTensor back(device(), DType::f32, std::vector<double>(x.size(), 0.0));
      dequantize_blockwise(code, e.codes.view(), e.absmax.view(), back.view());
      const std::vector<double> y = back.read();
      const auto& c = quant_code(code);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(y[i], static_cast<float>(c[static_cast<int>(q[i])] * static_cast<float>(absmax[i / kQuantBlock])));
      }
    }
  }
}

// With an absmax of 1 the scaled value is exact: a value exactly on the f32
// midpoint of two codes takes the lower code; a hair above it, the upper.
TEST_P(QuantizeBlockwise, AValueOnAMidpointTakesTheLowerCode) {
  const auto& c = quant_code(QuantCode::signed_dynamic);
  for (int i : {3, 100, 127, 130, 200, 253}) {
    const float mid = static_cast<float>((static_cast<double>(c[i]) + c[i + 1]) / 2);
    const Encoded e = encode(device(), QuantCode::signed_dynamic,
                             {1.0, mid, std::nextafter(mid, 2.0f), std::nextafter(mid, -2.0f)});
    const std::vector<double> q = e.codes.read();
    EXPECT_EQ(q[0], 255);
    EXPECT_EQ(q[1], i) << "midpoint of codes " << i << " and " << i + 1;
    EXPECT_EQ(q[2], i + 1);
    EXPECT_EQ(q[3], i);
  }
}

// The unsigned map (exp_avg_sq): a positive value far below its block's
// absmax takes the smallest positive code, never 0; an exact 0 takes 0. The
// signed map has no such floor (a first moment rounded to 0 only shortens a step).
TEST_P(QuantizeBlockwise, APositiveSecondMomentNeverEncodesAsZero) {
  const std::vector<double> x = {1.0, 1e-12, 0.0, 1e-30, 3e-8};
  const std::vector<double> q = encode(device(), QuantCode::unsigned_dynamic, x).codes.read();
  EXPECT_EQ(q, (std::vector<double>{255, 1, 0, 1, 1}));
  const std::vector<double> s = encode(device(), QuantCode::signed_dynamic, x).codes.read();
  EXPECT_EQ(s[1], 127) << "the signed map's zero code";
}

// Zeros encode as the code 0 with absmax 0; a NaN makes its block's absmax
// NaN (every value of the block decodes to NaN), an Inf makes it Inf; the
// other blocks are untouched.
TEST_P(QuantizeBlockwise, ZeroAndNonFiniteBlocks) {
  std::mt19937_64 rng(3);
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    std::vector<double> x = round_to(DType::f32, random_values(rng, 3 * kQuantBlock));
    for (int i = 0; i < kQuantBlock; ++i) x[i] = 0.0;
    x[kQuantBlock + 17] = bad;
    const Encoded e = encode(device(), QuantCode::signed_dynamic, x);
    const std::vector<double> q = e.codes.read(), absmax = e.absmax.read();
    EXPECT_EQ(absmax[0], 0.0);
    for (int i = 0; i < kQuantBlock; ++i) ASSERT_EQ(q[i], 127) << "the zero code";
    if (std::isnan(bad)) EXPECT_TRUE(std::isnan(absmax[1]));
    else EXPECT_EQ(absmax[1], INFINITY);
    EXPECT_EQ(absmax[2], block_absmax(x, 2 * kQuantBlock, 3 * kQuantBlock));
    TestTensor back(device(), DType::f32, std::vector<double>(x.size(), 0.0));
    dequantize_blockwise(QuantCode::signed_dynamic, e.codes.view(), e.absmax.view(), back.view());
    const std::vector<double> y = back.read();
    EXPECT_EQ(y[0], 0.0);
    if (std::isnan(bad)) EXPECT_TRUE(std::isnan(y[kQuantBlock]));
    EXPECT_TRUE(std::isfinite(y[2 * kQuantBlock]));
  }
}

TEST_P(QuantizeBlockwise, RejectsBadArgumentsWithoutWriting) {
  TestTensor values(device(), DType::f32, {1, 2, 3});
  TestTensor codes(device(), DType::u8, {9, 9, 9});
  TestTensor absmax(device(), DType::f32, {5});
  TestTensor long_absmax(device(), DType::f32, {5, 5});
  TestTensor f32_codes(device(), DType::f32, {9, 9, 9});
  const auto before = codes.bytes();
  expect_error([&] { quantize_blockwise(QuantCode::signed_dynamic, values.view(), codes.view(), long_absmax.view()); },
               ErrorCode::size_mismatch, {"absmax", "expected 1"});
  expect_error([&] { quantize_blockwise(QuantCode::signed_dynamic, values.view(), f32_codes.view(), absmax.view()); },
               ErrorCode::dtype_unsupported, {"codes", "u8"});
  expect_error([&] { quantize_blockwise(static_cast<QuantCode>(5), values.view(), codes.view(), absmax.view()); },
               ErrorCode::invalid_argument, {"code"});
  expect_error([&] { dequantize_blockwise(QuantCode::signed_dynamic, codes.view(), absmax.view(), codes.view()); },
               ErrorCode::dtype_unsupported, {"values", "f32"});
  EXPECT_EQ(codes.bytes(), before);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(QuantizeBlockwise);

}  // namespace
}  // namespace gradkit::test
