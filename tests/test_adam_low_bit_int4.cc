// 4-bit blockwise moments on every backend: the tables against their
// closed form, the whole-tensor encode against a float64 nearest-code
// search, adam_step's bad arguments with moment_bits = 4, and the owning
// Adam's 4-bit state file. What the 8- and 4-bit forms share (one step
// against the float64 reference, many steps, NaN, found_inf, determinism,
// CPU = CUDA) is tested for both in test_adam_low_bit.cc.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "spec/low_bit_tables.h"
#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/master.h"
#include "gradkit/optim/adam.h"
#include "support/adam_config.h"
#include "support/adam_reference.h"
#include "support/low_bit_adam.h"
#include "support/low_bit_reference.h"
#include "support/device_param.h"
#include "support/low_bit_checks.h"
#include "support/expect_error.h"
#include "support/state_file_bytes.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

using Config = AdamConfig;

std::vector<Config> configs() { return low_bit_configs(); }

// Odd sizes: a tensor's last byte then holds one code.
const std::vector<int64_t> kSizes = {1, 127, 128 + 7, 65536 + 301, 1001};

// The codes of a 4-bit tensor, one per element.
std::vector<int> unpacked(const TestTensor& packed, int64_t numel) {
  const std::vector<double> bytes = packed.read();
  std::vector<int> out(static_cast<size_t>(numel));
  for (int64_t e = 0; e < numel; ++e) out[e] = (static_cast<int>(bytes[e / 2]) >> ((e & 1) * 4)) & 0x0f;
  return out;
}

TEST(QuantizeBlockwiseInt4, TablesAreTheirClosedForm) {
  for (bool first : {true, false}) {
    const std::vector<double> want = round_to(DType::f32, reference_code4(first));
    const std::array<float, 16>& got = quant_code4(moment_code(first));
    for (int i = 0; i < 16; ++i) EXPECT_EQ(got[i], want[i]) << (first ? "signed" : "unsigned") << " code " << i;
  }
  EXPECT_EQ(quant_code4(QuantCode::unsigned_dynamic)[0], 0.00325f) << "no zero in the second moment's map";
  EXPECT_EQ(quant_code4(QuantCode::unsigned_dynamic)[1], 0.00325f) << "codes 0 and 1: the smallest value";
  EXPECT_EQ(quant_code4(QuantCode::unsigned_dynamic)[15], 1.0f);
}

// The three encodes of spec/low_bit_int4_math.h against the definition,
// counted here with std::lower_bound over the table's decision points: the
// bucketed count (quantize4; cuda/low_bit_codecs.cuh gives its count on
// every f32, test_low_bit_codecs_cuda), the CPU loops' 15 comparisons
// (quantize4_count) and the binary search (quantize4_search), for each
// bucket's edges and their neighbours, each decision point and its
// neighbours, both signs, values past 1 (a rounding of m / absmax), NaN, and
// a million values spread over every exponent below 2.
TEST(QuantizeBlockwiseInt4, EveryEncodeCountsTheDecisionPointsBelowEachValue) {
  using spec::bits_float;
  std::vector<float> x;
  const auto near = [&](uint32_t bits) {
    for (int64_t d = -3; d <= 3; ++d) {
      const int64_t b = static_cast<int64_t>(bits) + d;
      if (b < 0 || b >= 0x40000000) continue;  // |x| < 2: no finite m / absmax reaches 2
      x.push_back(bits_float(static_cast<uint32_t>(b)));
      x.push_back(-x.back());
    }
  };
  for (uint32_t bits = 0; bits < 0x40000000u; bits += 1u << 17) near(bits);  // every edge up to 6 fraction bits
  const spec::QuantTables4& tables = spec::quant_tables4();
  for (const spec::QuantTable4& t : tables.table) {
    for (int i = 0; i < 15; ++i) near(spec::magnitude_bits(t.midpoints[i]));
  }
  std::mt19937_64 rng(23);
  std::uniform_int_distribution<uint32_t> any_bits(0, 0x3fffffffu);
  for (int i = 0; i < 1000000; ++i) x.push_back(bits_float(any_bits(rng) | (i % 2 ? 0x80000000u : 0u)));
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  x.push_back(-std::numeric_limits<float>::quiet_NaN());
  for (int m = 0; m < 2; ++m) {
    const spec::QuantTable4& t = tables.table[m];
    for (float v : x) {
      const int want = std::isnan(v) ? 0 : static_cast<int>(std::lower_bound(t.midpoints, t.midpoints + 15, v) - t.midpoints);
      ASSERT_EQ(spec::quantize4(t, v), want) << "bucketed, table " << m << ", x = " << v;
      ASSERT_EQ(spec::quantize4_count(t, v), want) << "count, table " << m << ", x = " << v;
      ASSERT_EQ(spec::quantize4_search(t, v), want) << "search, table " << m << ", x = " << v;
    }
  }
}

// The CUDA kernels decode a code from its byte (dequantize4_byte, through
// the table of each byte's two values): the same value as dequantize4 of
// the byte's nibble, for every byte, both halves, both tables.
TEST(QuantizeBlockwiseInt4, EveryByteDecodesAsItsNibbles) {
  const spec::QuantTables4& tables = spec::quant_tables4();
  for (const spec::QuantTable4& t : tables.table) {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      for (int h = 0; h < 2; ++h) {
        for (float absmax : {1.0f, 0.37f, 3.0e-7f}) {
          const float want = spec::dequantize4(t, spec::nibble(static_cast<uint8_t>(byte), h), absmax);
          ASSERT_EQ(spec::float_bits(spec::dequantize4_byte(t, byte, h, absmax)), spec::float_bits(want))
              << "byte " << byte << ", half " << h;
        }
      }
    }
  }
}

// Everything one 4-bit step reads and writes, on one device.
struct Tensors : LowBitTensors {
  Tensors(Device device, const Config& c, uint64_t seed) : LowBitTensors(device, c, seed, 4, kSizes, 2, 1) {}
};

using QuantizeBlockwiseInt4OnDevice = OnEachDevice;

// Values across three decades, zeros and exact codes: each code the nearest
// (or a neighbour at a near-tie), decoding gives code * absmax, and an odd
// tensor's last byte keeps its high nibble 0.
TEST_P(QuantizeBlockwiseInt4OnDevice, EncodesTheNearestCodeAndDecodesIt) {
  std::mt19937_64 rng(21);
  for (bool first : {true, false}) {
    const int64_t n = 3 * kQuant4Block + 5;
    std::vector<double> x = moment_values(rng, n, first, -3);
    x[3] = 0.0;
    x[kQuant4Block + 1] = x[kQuant4Block];  // a repeated value
    const TestTensor values(device(), DType::f32, x);
    TestTensor codes(device(), DType::u8, std::vector<double>(quant4_bytes(n), 0.0)),
        absmax(device(), DType::f32, std::vector<double>(quant4_blocks(n), 0.0)),
        back(device(), DType::f32, std::vector<double>(n, 0.0));
    quantize_blockwise4(moment_code(first), values.view(), codes.view(), absmax.view());
    dequantize_blockwise4(moment_code(first), codes.view(), absmax.view(), back.view());
    const std::vector<int> q = unpacked(codes, n);
    const std::vector<double> amax = absmax.read();
    expect_encoded(x, std::vector<double>(q.begin(), q.end()), amax, first, first ? "signed" : "unsigned", 4);
    const std::vector<double> decoded = back.read();
    const std::array<float, 16>& table = quant_code4(moment_code(first));
    for (int64_t e = 0; e < n; ++e) {
      ASSERT_EQ(decoded[e], static_cast<float>(table[q[e]] * static_cast<float>(amax[e / kQuant4Block]))) << e;
    }
    EXPECT_EQ(static_cast<int>(codes.read().back()) >> 4, 0) << "the unused high nibble";
  }
}

TEST_P(QuantizeBlockwiseInt4OnDevice, RejectsBadArgumentsNamingThem) {
  const int64_t n = 300;
  const TestTensor values(device(), DType::f32, std::vector<double>(n, 0.5));
  TestTensor codes(device(), DType::u8, std::vector<double>(quant4_bytes(n), 7.0)),
      short_codes(device(), DType::u8, std::vector<double>(n / 2 - 1, 7.0)),
      absmax(device(), DType::f32, std::vector<double>(quant4_blocks(n), 3.0));
  const auto before = codes.bytes();
  expect_error([&] { quantize_blockwise4(QuantCode::signed_dynamic, values.view(), short_codes.view(), absmax.view()); },
               ErrorCode::size_mismatch, {"codes"});
  expect_error([&] { quantize_blockwise4(static_cast<QuantCode>(5), values.view(), codes.view(), absmax.view()); },
               ErrorCode::invalid_argument, {"code"});
  EXPECT_EQ(codes.bytes(), before);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(QuantizeBlockwiseInt4OnDevice);

using AdamInt4 = OnEachDevice;

TEST_P(AdamInt4, RejectsBadArgumentsNamingThem) {
  const Config c = configs()[0];
  Tensors t(device(), c, 6);
  const auto before = t.bytes();
  const AdamTensors x = t.tensors(c);
  auto plan = [&](const AdamTensors& tensors, AdamHyperparameters hyper = {}) { AdamPlan(tensors, std::span(&hyper, 1)); };

  AdamTensors bits = x;
  bits.moment_bits = 5;
  expect_error([&] { plan(bits); }, ErrorCode::invalid_argument, {"moment_bits", "expected 8 or 4"});

  AdamHyperparameters ams;
  ams.amsgrad = true;
  AdamTensors with_max = x;
  with_max.max_exp_avg_sq = x.exp_avg_sq;
  expect_error([&] { plan(with_max, ams); }, ErrorCode::invalid_argument, {"hyperparameters[0].amsgrad", "4-bit"});

  std::vector<TensorView> wrong_bytes = t.mv;
  wrong_bytes[3].numel = kSizes[3];  // one byte per element: the 8-bit size
  AdamTensors bytes = x;
  bytes.exp_avg = wrong_bytes;
  expect_error([&] { plan(bytes); }, ErrorCode::size_mismatch, {"exp_avg[3]"});

  std::vector<TensorView> wrong_blocks = t.amv;
  wrong_blocks[2].numel = quant_blocks(kSizes[2]);  // 8-bit blocks
  AdamTensors blocks = x;
  blocks.exp_avg_absmax = wrong_blocks;
  expect_error([&] { plan(blocks); }, ErrorCode::size_mismatch, {"exp_avg_absmax[2]", "expected 2"});

  std::vector<TestTensor> f32_m;
  for (int64_t n : kSizes) f32_m.emplace_back(device(), DType::f32, std::vector<double>(n, 0.0));
  const auto f32_views = views(f32_m);
  AdamTensors dense = x;
  dense.exp_avg = f32_views;
  dense.exp_avg_sq = f32_views;
  dense.exp_avg_absmax = {};
  dense.exp_avg_sq_absmax = {};
  expect_error([&] { plan(dense); }, ErrorCode::invalid_argument, {"moment_bits", "u8"});
  EXPECT_EQ(t.bytes(), before);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(AdamInt4);

// The owning Adam with 4-bit moments: a resumed run equals the straight one
// bit for bit (low_bit_checks.h); an 8-bit optimizer refuses the 4-bit file (and
// the 4-bit one the 8-bit file), naming the moments, before it writes anything.
using AdamInt4Optimizer = OnEachDevice;

TEST_P(AdamInt4Optimizer, ResumeFromAFileEqualsTheStraightRun) {
  AdamGroup group;
  group.hyperparameters.weight_decay = 0.01f;
  // 1.06 per parameter plus each tensor's 256-byte alignment: 1.10 on this model of 73K
  // parameters in 4 tensors, two of them tiny (GPT-2's list: 1.06).
  expect_resumed_run_equals_straight_run<Adam>(device(), group, AdamOptions{.moment_dtype = DType::u8, .moment_bits = 4},
                                               {1.11, quant4_bytes(70001), quant4_blocks(70001)});
}

TEST_P(AdamInt4Optimizer, EightAndFourBitFilesLoadOnlyIntoTheirOwnForm) {
  AdamGroup group;
  OwningModel model(device(), 5);
  Adam four(model.groups(group), AdamOptions{.moment_dtype = DType::u8, .moment_bits = 4});
  Adam eight(model.groups(group), AdamOptions{.moment_dtype = DType::u8});
  std::mt19937_64 rng(6);
  model.new_gradients(rng);
  four.step();
  eight.step();
  const std::string path = ::testing::TempDir() + "gradkit_4bit_form_" + std::to_string(::getpid());
  four.save(path);
  eight.save(path + "_8bit");
  const auto four_state = moment_state(four), eight_state = moment_state(eight);
  expect_error([&] { eight.load(path); }, ErrorCode::io_error, {"u4 (4-bit moments)", "expected u8 (8-bit moments)"});
  expect_error([&] { four.load(path + "_8bit"); }, ErrorCode::io_error, {"u8 (8-bit moments)", "expected u4"});
  EXPECT_EQ(moment_state(four), four_state);
  EXPECT_EQ(moment_state(eight), eight_state);
  std::remove(path.c_str());
  std::remove((path + "_8bit").c_str());
}

// Format version 3 kept the second moment on the linear map (i + 1) / 16: its
// codes stand for other values than today's, so its 4-bit file (moment code
// 5) is refused, saying why, and nothing is loaded.
TEST_P(AdamInt4Optimizer, AFormat3FourBitFileIsRefused) {
  AdamGroup group;
  OwningModel model(device(), 7);
  Adam four(model.groups(group), AdamOptions{.moment_dtype = DType::u8, .moment_bits = 4});
  std::mt19937_64 rng(8);
  model.new_gradients(rng);
  four.step();
  const std::string path = ::testing::TempDir() + "gradkit_4bit_v3_" + std::to_string(::getpid());
  four.save(path);
  std::vector<RawSection> sections = read_raw_sections(path);
  put_at(find_section(sections, "meta").bytes, 8, uint32_t{5});  // the moment code, after the i64 step
  write_raw_state_file(path, sections, 3);
  model.new_gradients(rng);
  four.step();
  const auto state = moment_state(four);
  expect_error([&] { four.load(path); }, ErrorCode::io_error,
               {path, "linear map", "format version 3", "expected u4 (4-bit moments)"});
  EXPECT_EQ(moment_state(four), state);
  EXPECT_EQ(four.step_count(), 2);
  std::remove(path.c_str());
}

TEST_P(AdamInt4Optimizer, RejectsWhatCannotWork) {
  OwningModel model(device(), 1);
  AdamGroup group;
  expect_error([&] { Adam(model.groups(group), AdamOptions{.moment_dtype = DType::u8, .moment_bits = 2}); },
               ErrorCode::invalid_argument, {"options.moment_bits", "expected 8 or 4"});
  expect_error([&] { Adam(model.groups(group), AdamOptions{.moment_dtype = DType::f32, .moment_bits = 4}); },
               ErrorCode::invalid_argument, {"options.moment_bits", "u8"});
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(AdamInt4Optimizer);

}  // namespace
}  // namespace gradkit::test
