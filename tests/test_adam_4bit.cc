// 4-bit blockwise moments on every backend: the tables against their
// closed form, the whole-tensor encode against a float64 nearest-code
// search, adam_step with moment_bits = 4 against a float64 reference
// (decode, update, encode) within one code, many steps beside the f32
// moments, skipped and non-finite steps, determinism, bad arguments; and
// the CPU and CUDA backends bit for bit.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/blockwise.h"
#include "gradkit/ops/master.h"
#include "gradkit/optim/adam.h"
#include "support/adam_config.h"
#include "support/adam_reference.h"
#include "support/blockwise_reference.h"
#include "support/device_param.h"
#include "support/eight_bit.h"
#include "support/expect_error.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

using Config = AdamConfig;

std::vector<Config> configs() {
  std::vector<Config> out;
  Config adamw{"adamw"};
  adamw.h.weight_decay = 0.01f;
  out.push_back(adamw);
  Config l2{"l2_bf16_grads_bf16_copy"};
  l2.h.decay = WeightDecay::l2;
  l2.h.weight_decay = 0.05f;
  l2.grad = DType::bf16;
  l2.copy = DType::bf16;
  out.push_back(l2);
  Config hf{"hugging_face_f16_grads_scaled"};
  hf.h.decay = WeightDecay::hugging_face;
  hf.h.weight_decay = 0.02f;
  hf.grad = DType::f16;
  hf.grad_scale = 1024.0f;
  out.push_back(hf);
  Config pair{"remainder_weights_maximize_nobias"};
  pair.h.maximize = true;
  pair.h.bias_correction = false;
  pair.remainder = true;
  pair.grad = DType::bf16;
  out.push_back(pair);
  return out;
}

// Odd sizes: a tensor's last byte then holds one code.
const std::vector<int64_t> kSizes = {1, 127, 128 + 7, 65536 + 301, 1001};

QuantCode code_of(bool first) { return first ? QuantCode::signed_dynamic : QuantCode::unsigned_dynamic; }

// The codes of a 4-bit tensor, one per element.
std::vector<int> unpacked(const TestTensor& packed, int64_t numel) {
  const std::vector<double> bytes = packed.read();
  std::vector<int> out(static_cast<size_t>(numel));
  for (int64_t e = 0; e < numel; ++e) out[e] = (static_cast<int>(bytes[e / 2]) >> ((e & 1) * 4)) & 0x0f;
  return out;
}

// The encoding of `want` in (codes, absmax): each block's absmax agrees to
// f32 rounding, each code is the reference's nearest or a neighbour (f32
// arithmetic may land on the other side of a decision point).
void expect_encoded4(const std::vector<double>& want, const std::vector<int>& codes, const std::vector<double>& absmax,
                     bool first, const std::string& what) {
  const std::vector<double> table = reference_code4(first);
  for (size_t b = 0; b < absmax.size(); ++b) {
    const size_t end = std::min(want.size(), (b + 1) * kQuant4Block);
    const double want_absmax = block_absmax(want, b * kQuant4Block, end);
    ASSERT_NEAR(absmax[b], want_absmax, 8 * 0x1p-24 * want_absmax) << what << " block " << b;
    for (size_t k = b * kQuant4Block; k < end; ++k) {
      const int expected = want_absmax == 0 ? 0 : nearest_code(table, want[k] / want_absmax).index;
      ASSERT_LE(std::abs(codes[k] - expected), 1) << what << (first ? " exp_avg" : " exp_avg_sq") << " element " << k;
    }
  }
}

TEST(Blockwise4, TablesAreTheirClosedForm) {
  for (bool first : {true, false}) {
    const std::vector<double> want = round_to(DType::f32, reference_code4(first));
    const std::array<float, 16>& got = quant_code4(code_of(first));
    for (int i = 0; i < 16; ++i) EXPECT_EQ(got[i], want[i]) << (first ? "signed" : "linear") << " code " << i;
  }
  EXPECT_EQ(quant_code4(QuantCode::unsigned_dynamic)[0], 1.0f / 16) << "no zero in the second moment's map";
}

// Everything one 4-bit step reads and writes, on one device.
struct Tensors {
  std::vector<TestTensor> w, rem, copy, g, m, v, am, av;

  Tensors(Device device, const Config& c, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n : kSizes) {
      const std::vector<double> master = round_to(DType::f32, random_values(rng, n));
      if (c.remainder) {
        const TestTensor f32(device, DType::f32, master);
        w.emplace_back(device, DType::bf16, std::vector<double>(n, 0.0));
        rem.emplace_back(device, DType::i16, std::vector<double>(n, 0.0));
        split_masters(f32.view(), w.back().view(), rem.back().view());
      } else {
        w.emplace_back(device, DType::f32, master);
      }
      copy.emplace_back(device, DType::bf16, std::vector<double>(n, 0.0));
      g.emplace_back(device, c.grad, round_to(c.grad, random_values(rng, n, c.grad_scale)));
      m.emplace_back(device, DType::u8, std::vector<double>(quant4_bytes(n), 0.0));
      v.emplace_back(device, DType::u8, std::vector<double>(quant4_bytes(n), 0.0));
      am.emplace_back(device, DType::f32, std::vector<double>(quant4_blocks(n), 0.0));
      av.emplace_back(device, DType::f32, std::vector<double>(quant4_blocks(n), 0.0));
      const TestTensor m0(device, DType::f32, moment_values(rng, n, true, -2)),
          v0(device, DType::f32, moment_values(rng, n, false, -1));
      quantize_blockwise4(QuantCode::signed_dynamic, m0.view(), m.back().view(), am.back().view());
      quantize_blockwise4(QuantCode::unsigned_dynamic, v0.view(), v.back().view(), av.back().view());
    }
    refresh_views();
  }
  void refresh_views() {
    wv = views(w), rv = views(rem), cv = views(copy), gv = views(g), mv = views(m), vv = views(v), amv = views(am),
    avv = views(av);
  }
  AdamTensors tensors(const Config& c) const {
    AdamTensors t{wv, gv, mv, vv, {}, {}, amv, avv, {}};
    t.moment_bits = 4;
    if (c.copy != DType::f32) t.model_copy = cv;
    if (c.remainder) t.weight_remainder = rv;
    return t;
  }
  std::vector<double> masters(size_t i) const {
    if (rem.empty()) return w[i].read();
    TestTensor out(w[i].view().device, DType::f32, std::vector<double>(w[i].numel(), 0.0));
    join_masters(w[i].view(), rem[i].view(), out.view());
    return out.read();
  }
  std::vector<double> decoded(size_t i, bool first) const {
    TestTensor out(w[i].view().device, DType::f32, std::vector<double>(w[i].numel(), 0.0));
    dequantize_blockwise4(code_of(first), (first ? m : v)[i].view(), (first ? am : av)[i].view(), out.view());
    return out.read();
  }
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &rem, &copy, &m, &v, &am, &av}) {
      for (const auto& t : *list) out.push_back(t.bytes());
    }
    return out;
  }

  std::vector<TensorView> wv, rv, cv, gv, mv, vv, amv, avv;
};

using Blockwise4OnDevice = OnEachDevice;

// Values across three decades, zeros and exact codes: each code the nearest
// (or a neighbour at a near-tie), decoding gives code * absmax, and an odd
// tensor's last byte keeps its high nibble 0.
TEST_P(Blockwise4OnDevice, EncodesTheNearestCodeAndDecodesIt) {
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
    quantize_blockwise4(code_of(first), values.view(), codes.view(), absmax.view());
    dequantize_blockwise4(code_of(first), codes.view(), absmax.view(), back.view());
    const std::vector<int> q = unpacked(codes, n);
    const std::vector<double> amax = absmax.read();
    expect_encoded4(x, q, amax, first, first ? "signed" : "linear");
    const std::vector<double> decoded = back.read();
    const std::array<float, 16>& table = quant_code4(code_of(first));
    for (int64_t e = 0; e < n; ++e) {
      ASSERT_EQ(decoded[e], static_cast<float>(table[q[e]] * static_cast<float>(amax[e / kQuant4Block]))) << e;
    }
    EXPECT_EQ(static_cast<int>(codes.read().back()) >> 4, 0) << "the unused high nibble";
  }
}

TEST_P(Blockwise4OnDevice, RejectsBadArgumentsNamingThem) {
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

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Blockwise4OnDevice);

using Adam4bit = OnEachDevice;

// Decode, update in f64, encode in f64: absmax to f32 rounding, codes the
// reference's or a neighbour, weights to f32 rounding (updated from the f32
// moments, before encoding).
TEST_P(Adam4bit, OneStepMatchesTheReferenceWithinOneCode) {
  uint64_t seed = 40;
  for (const Config& c : configs()) {
    Tensors t(device(), c, seed++);
    const int64_t step = 5;
    std::vector<AdamReferenceState> ref;
    for (size_t i = 0; i < kSizes.size(); ++i) ref.push_back({t.masters(i), t.decoded(i, true), t.decoded(i, false), {}});
    AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = step, .grad_scale = c.grad_scale});
    synchronize(device());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      const std::string what = c.name + " tensor " + std::to_string(i);
      reference_adam_step(ref[i], t.g[i].read(), c.h, step, c.grad_scale, DType::f64, DType::f64);
      EXPECT_LE(relative_error(t.masters(i), ref[i].w), optimizer_tolerance(DType::f32, 1)) << what << " (weights)";
      for (bool first : {true, false}) {
        expect_encoded4(first ? ref[i].m : ref[i].v, unpacked((first ? t.m : t.v)[i], kSizes[i]),
                        (first ? t.am : t.av)[i].read(), first, what);
      }
      if (c.copy != DType::f32) EXPECT_EQ(t.copy[i].read(), round_to(DType::bf16, t.w[i].read())) << what << " (copy)";
    }
  }
}

// Over many steps the 4-bit moments follow the f32 moments' path, more
// loosely than 8-bit ones (16 codes): the weights' movement differs by at
// about a quarter (0.28 measured on this case, against under 0.05 for
// 8-bit): a v far below its block's absmax is stored as absmax / 16, which
// shortens its steps (docs/ops.md, "4-bit moments").
TEST_P(Adam4bit, ManyStepsFollowTheF32MomentPath) {
  std::mt19937_64 rng(5);
  const int64_t n = 65536 + 1001;
  const std::vector<double> w0 = round_to(DType::f32, random_values(rng, n));
  TestTensor w4(device(), DType::f32, w0), w32(device(), DType::f32, w0), g(device(), DType::f32, w0);
  TestTensor q_m(device(), DType::u8, std::vector<double>(quant4_bytes(n), 0x77)),
      q_v(device(), DType::u8, std::vector<double>(quant4_bytes(n), 0));
  TestTensor am(device(), DType::f32, std::vector<double>(quant4_blocks(n), 0)),
      av(device(), DType::f32, std::vector<double>(quant4_blocks(n), 0));
  TestTensor m(device(), DType::f32, std::vector<double>(n, 0)), v(device(), DType::f32, std::vector<double>(n, 0));
  const TensorView W4[] = {w4.view()}, W32[] = {w32.view()}, G[] = {g.view()}, QM[] = {q_m.view()}, QV[] = {q_v.view()},
                   AM[] = {am.view()}, AV[] = {av.view()}, M[] = {m.view()}, V[] = {v.view()};
  AdamHyperparameters h;
  h.lr = 1e-3f;
  AdamTensors four{W4, G, QM, QV, {}, {}, AM, AV, {}};
  four.moment_bits = 4;
  const AdamPlan low(four, std::span(&h, 1)), full({W32, G, M, V, {}, {}}, std::span(&h, 1));
  std::normal_distribution<double> noise(0.0, 1.0);
  for (int step = 1; step <= 50; ++step) {
    std::vector<double> grad(n);
    for (int64_t k = 0; k < n; ++k) grad[k] = 0.01 * w0[k] + 0.005 * noise(rng);
    const TestTensor fresh(device(), DType::f32, grad);
    copy_from_host(g.view().data, device(), fresh.bytes().data(), fresh.bytes().size());
    low.step({.step = step});
    full.step({.step = step});
  }
  synchronize(device());
  const std::vector<double> a = w4.read(), b = w32.read();
  double diff = 0, moved = 0;
  for (int64_t k = 0; k < n; ++k) {
    diff += (a[k] - b[k]) * (a[k] - b[k]);
    moved += (b[k] - w0[k]) * (b[k] - w0[k]);
  }
  EXPECT_LT(std::sqrt(diff / moved), 0.35);
}

// A small gradient in a block beside a large one: the linear map has no
// zero, so the small element's v is stored as at least 1/16 of the block's
// absmax, which only shortens its step: no weight moves further than lr.
TEST_P(Adam4bit, ASmallGradientBesideALargeOneStepsNoFurtherThanLr) {
  const int64_t n = kQuant4Block;
  std::vector<double> grad(n, 1e-4);
  grad[0] = 1.0;
  TestTensor w(device(), DType::f32, std::vector<double>(n, 0.5)), g(device(), DType::f32, grad);
  TestTensor qm(device(), DType::u8, std::vector<double>(n / 2, 0)), qv(device(), DType::u8, std::vector<double>(n / 2, 0));
  TestTensor am(device(), DType::f32, {0.0}), av(device(), DType::f32, {0.0});
  const TensorView W[] = {w.view()}, G[] = {g.view()}, QM[] = {qm.view()}, QV[] = {qv.view()}, AM[] = {am.view()},
                   AV[] = {av.view()};
  AdamHyperparameters h;
  h.lr = 1e-3f;
  AdamTensors t{W, G, QM, QV, {}, {}, AM, AV, {}};
  t.moment_bits = 4;
  const AdamPlan plan(t, std::span(&h, 1));
  std::vector<double> before = w.read();
  for (int step = 1; step <= 40; ++step) {
    plan.step({.step = step});
    const std::vector<double> after = w.read();
    for (int64_t k = 0; k < n; ++k) ASSERT_LE(std::abs(after[k] - before[k]), 1.5 * h.lr) << "step " << step << " element " << k;
    before = after;
  }
}

TEST_P(Adam4bit, FoundInfSkipsTheWholeStep) {
  const Config c = configs()[0];
  Tensors t(device(), c, 3);
  const auto before = t.bytes();
  TestFlag found(device(), true);
  AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = 1, .found_inf = found.pointer()});
  synchronize(device());
  EXPECT_EQ(t.bytes(), before);
}

// Without found_inf, a NaN gradient makes its element's weight NaN and its
// blocks' absmax NaN; other blocks and tensors are untouched by it.
TEST_P(Adam4bit, ANanGradientPoisonsOnlyItsBlock) {
  const Config c = configs()[0];
  Tensors t(device(), c, 4), clean(device(), c, 4);
  const size_t i = 3;
  std::vector<double> grad = t.g[i].read();
  grad[300] = std::numeric_limits<double>::quiet_NaN();  // block 2
  t.g[i] = TestTensor(device(), DType::f32, grad);
  t.refresh_views();
  AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = 1});
  AdamPlan(clean.tensors(c), std::span(&c.h, 1)).step({.step = 1});
  synchronize(device());
  const auto am = t.am[i].read(), clean_am = clean.am[i].read();
  EXPECT_TRUE(std::isnan(am[2]));
  EXPECT_TRUE(std::isnan(t.w[i].read()[300]));
  for (size_t b = 0; b < am.size(); ++b) {
    if (b != 2) ASSERT_EQ(am[b], clean_am[b]) << "block " << b;
  }
  EXPECT_EQ(t.m[0].bytes(), clean.m[0].bytes());
}

TEST_P(Adam4bit, BitwiseDeterministic) {
  for (const Config& c : configs()) {
    Tensors a(device(), c, 9), b(device(), c, 9);
    for (int step = 1; step <= 3; ++step) {
      AdamPlan(a.tensors(c), std::span(&c.h, 1)).step({.step = step});
      AdamPlan(b.tensors(c), std::span(&c.h, 1)).step({.step = step});
    }
    synchronize(device());
    EXPECT_EQ(a.bytes(), b.bytes()) << c.name;
  }
}

TEST_P(Adam4bit, RejectsBadArgumentsNamingThem) {
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

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Adam4bit);

// The owning Adam with 4-bit moments: about 1 byte of state per parameter;
// 3 steps, saved, 4 more; a second optimizer loads the file and takes the
// same 4 steps: the same weights and state, bit for bit. An 8-bit optimizer
// refuses the 4-bit file (and the 4-bit one the 8-bit file), naming the
// moments, before it writes anything.
using Adam4bitOptimizer = OnEachDevice;

TEST_P(Adam4bitOptimizer, ResumeFromAFileEqualsTheStraightRun) {
  AdamGroup group;
  group.hyperparameters.weight_decay = 0.01f;
  const AdamOptions four{.moment_dtype = DType::u8, .moment_bits = 4};
  OwningModel straight(device(), 5), resumed(device(), 5);
  Adam first(straight.groups(group), four);
  // 1.06 per parameter plus each tensor's 256-byte alignment: 1.10 on this model of 73K
  // parameters in 4 tensors, two of them tiny (GPT-2's list: 1.06).
  EXPECT_LE(static_cast<double>(first.state_bytes()) / straight.numel(), 1.11) << "bytes of state per parameter";
  EXPECT_EQ(first.exp_avg()[2].numel, quant4_bytes(70001));
  EXPECT_EQ(first.exp_avg_absmax()[2].numel, quant4_blocks(70001));
  std::mt19937_64 rng(6);
  for (int s = 0; s < 3; ++s) {
    straight.new_gradients(rng);
    first.step();
  }
  const std::string path = ::testing::TempDir() + "gradkit_4bit_resume_" + std::to_string(::getpid());
  first.save(path);
  for (size_t i = 0; i < straight.w.size(); ++i) {
    copy_from_host(resumed.w[i].view().data, device(), straight.w[i].bytes().data(), straight.w[i].bytes().size());
  }
  std::mt19937_64 rng_resumed = rng;
  for (int s = 0; s < 4; ++s) {
    straight.new_gradients(rng);
    first.step();
  }
  Adam second(resumed.groups(group), four);
  second.load(path);
  EXPECT_EQ(second.step_count(), 3);
  for (int s = 0; s < 4; ++s) {
    resumed.new_gradients(rng_resumed);
    second.step();
  }
  EXPECT_EQ(resumed.bits(), straight.bits());
  EXPECT_EQ(moment_state(second), moment_state(first));

  Adam eight(resumed.groups(group), AdamOptions{.moment_dtype = DType::u8});
  const auto before = moment_state(eight);
  expect_error([&] { eight.load(path); }, ErrorCode::io_error, {"u4 (4-bit moments)", "expected u8 (8-bit moments)"});
  EXPECT_EQ(moment_state(eight), before);
  const std::string eight_path = path + "_8bit";
  eight.save(eight_path);
  expect_error([&] { second.load(eight_path); }, ErrorCode::io_error, {"u8 (8-bit moments)", "expected u4"});
  std::remove(path.c_str());
  std::remove(eight_path.c_str());
}

TEST_P(Adam4bitOptimizer, RejectsWhatCannotWork) {
  OwningModel model(device(), 1);
  AdamGroup group;
  expect_error([&] { Adam(model.groups(group), AdamOptions{.moment_dtype = DType::u8, .moment_bits = 2}); },
               ErrorCode::invalid_argument, {"options.moment_bits", "expected 8 or 4"});
  expect_error([&] { Adam(model.groups(group), AdamOptions{.moment_dtype = DType::f32, .moment_bits = 4}); },
               ErrorCode::invalid_argument, {"options.moment_bits", "u8"});
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Adam4bitOptimizer);

// The same steps on the CPU and on CUDA give the same bytes: weights,
// remainders, copies, codes, absmax.
TEST(Adam4bitBackends, CpuAndCudaAgreeBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  for (const Config& c : configs()) {
    Tensors cpu(Device::cpu(), c, 77), gpu(Device::cuda(0), c, 77);
    const AdamPlan on_cpu(cpu.tensors(c), std::span(&c.h, 1)), on_gpu(gpu.tensors(c), std::span(&c.h, 1));
    for (int step = 1; step <= 20; ++step) {
      on_cpu.step({.step = step, .grad_scale = c.grad_scale});
      on_gpu.step({.step = step, .grad_scale = c.grad_scale});
    }
    synchronize(Device::cuda(0));
    EXPECT_EQ(cpu.bytes(), gpu.bytes()) << c.name;
  }
}

}  // namespace
}  // namespace gradkit::test
