// lamb_step with 8- and 4-bit blockwise moments on every backend, the same
// checks for both forms: one step against a float64 reference (decode,
// update, encode; pass 2 from the stored moments) within one code, the
// low-bit path following the f32 one, the split step, the block rule for
// non-finite directions, skipped steps, bad arguments, the owning Lamb's
// checkpoints; and CPU = CUDA bit for bit.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/lamb.h"
#include "gradkit/optim/lamb.h"
#include "support/low_bit_reference.h"
#include "support/device_param.h"
#include "support/low_bit_checks.h"
#include "support/expect_error.h"
#include "support/low_bit_moments.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

struct Config {
  std::string name;
  LambHyperparameters h;
  DType grad = DType::f32;
  DType copy = DType::f32;  // f16/bf16: a model copy
  bool update = false;      // write the delta instead of the weights
  float loss_scale = 1.0f, gradient_norm = -1.0f;
};

std::vector<Config> configs() {
  std::vector<Config> out;
  Config base{"default"};
  base.h.lambda = 0.01f;
  out.push_back(base);
  Config clipped{"bf16_grads_f16_copy_scaled_clipped_clamped"};
  clipped.h.lambda = 0.02f;
  clipped.h.ratio_min = 0.05f;
  clipped.h.ratio_max = 5.0f;
  clipped.grad = DType::bf16;
  clipped.copy = DType::f16;
  clipped.loss_scale = 256.0f;
  clipped.gradient_norm = 256.0f * 300.0f;  // unscaled norm 300 > max_norm 1
  out.push_back(clipped);
  Config delta{"update_list_no_bias_correction"};
  delta.h.bias_correction = false;
  delta.update = true;
  out.push_back(delta);
  return out;
}

// Each form's sizes: a short last block, one element, one past a chunk
// (4-bit: odd, so that a last byte holds one code), and 13 whole spans of
// 256 and a short one of 5: CUDA's pass 1 reads whole spans in a loop of
// their own and the short one apart (cuda/lamb_low_bit.cu).
std::vector<int64_t> sizes_of(int bits) {
  return bits == 4 ? std::vector<int64_t>{1, 127, 128 + 7, 65536 + 301, 1001, 13 * 256 + 5}
                   : std::vector<int64_t>{1, 255, 256 + 7, 65536 + 300, 1000, 13 * 256 + 5};
}

struct Tensors : LowBitMoments {
  std::vector<TestTensor> w, g, copy, update;
  std::vector<TensorView> wv, gv, mv, vv, amv, avv, cv, uv;

  Tensors(Device device, const Config& c, uint64_t seed, int32_t moment_bits, std::vector<int64_t> sizes = {})
      : LowBitMoments(moment_bits) {
    if (sizes.empty()) sizes = sizes_of(bits);
    std::mt19937_64 rng(seed);
    for (int64_t n : sizes) {
      w.emplace_back(device, DType::f32, round_to(DType::f32, random_values(rng, n)));
      g.emplace_back(device, c.grad, round_to(c.grad, random_values(rng, n, c.loss_scale)));
      if (c.copy != DType::f32) copy.emplace_back(device, c.copy, std::vector<double>(n, 0.0));
      if (c.update) update.emplace_back(device, DType::f32, std::vector<double>(n, 0.0));
      const std::vector<double> m0 = moment_values(rng, n, true, -3);
      const std::vector<double> v0 = moment_values(rng, n, false, -3);
      add_moments(device, m0, v0);
    }
    refresh();
  }
  void refresh() {
    wv = views(w), gv = views(g), mv = views(m), vv = views(v), amv = views(am), avv = views(av), cv = views(copy),
    uv = views(update);
  }
  LambTensors tensors() const { return {wv, gv, mv, vv, cv, uv, amv, avv, {}, bits}; }
  void new_gradients(std::mt19937_64& rng, DType grad, float scale) {
    for (auto& t : g) {
      const TestTensor fresh(t.view().device, grad, random_values(rng, t.numel(), scale));
      copy_from_host(t.view().data, t.view().device, fresh.bytes().data(), fresh.bytes().size());
    }
  }
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &m, &v, &am, &av, &copy, &update}) {
      for (const auto& t : *list) out.push_back(t.bytes());
    }
    return out;
  }
};

LambStepInputs inputs(const Config& c, int64_t step) {
  LambStepInputs in;
  in.eta = 0.01f;
  in.loss_scale = c.loss_scale;
  in.gradient_norm = c.gradient_norm;
  in.step = step;
  return in;
}

// f64 decode of codes (one per element) with the reference tables.
std::vector<double> reference_decode(const std::vector<double>& codes, const std::vector<double>& absmax, bool first,
                                     int bits) {
  const std::vector<double> table = bits == 4 ? reference_code4(first) : reference_code(first);
  std::vector<double> out(codes.size());
  for (size_t k = 0; k < codes.size(); ++k) out[k] = table[static_cast<size_t>(codes[k])] * absmax[k / quant_block_of(bits)];
  return out;
}

class LambLowBit : public ::testing::TestWithParam<std::tuple<Device, int>> {
 protected:
  void SetUp() override {
    if (device().is_cuda() && !cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
  Device device() const { return std::get<0>(GetParam()); }
  int bits() const { return std::get<1>(GetParam()); }
  Tensors make(const Config& c, uint64_t seed, std::vector<int64_t> sizes = {}) const {
    return Tensors(device(), c, seed, bits(), std::move(sizes));
  }
};

// Pass 1 in f64 from the decoded moments: the kernel's absmax agrees to f32
// rounding and its codes are the nearest or a neighbour (f32 arithmetic may
// land on the other side of a decision point). Pass 2 in f64 from the
// stored moments (the kernel's codes, decoded in f64): the trust ratio and
// the weights agree to f32 rounding.
TEST_P(LambLowBit, OneStepMatchesTheReferenceWithinOneCode) {
  uint64_t seed = 70;
  for (const Config& c : configs()) {
    Tensors t = make(c, seed++);
    const int64_t step = 4;
    std::vector<std::vector<double>> w0, m0, v0;
    for (size_t i = 0; i < t.w.size(); ++i) {
      w0.push_back(t.w[i].read()), m0.push_back(t.decoded(i, true)), v0.push_back(t.decoded(i, false));
    }
    LambPlan(t.tensors(), std::span(&c.h, 1)).step(inputs(c, step));
    synchronize(device());
    double scale = c.loss_scale;
    if (c.gradient_norm >= 0 && c.gradient_norm / scale > c.h.max_norm) scale = c.gradient_norm / c.h.max_norm;
    const double bias1 = c.h.bias_correction ? 1 - std::pow(double{c.h.alpha}, step) : 1;
    const double bias2 = c.h.bias_correction ? 1 - std::pow(double{c.h.beta}, step) : 1;
    for (size_t i = 0; i < t.w.size(); ++i) {
      const std::string what = c.name + " tensor " + std::to_string(i);
      const std::vector<double> grad = t.g[i].read();
      const size_t n = grad.size();
      std::vector<double> m(n), v(n);
      for (size_t k = 0; k < n; ++k) {
        const double gk = grad[k] / scale;
        m[k] = c.h.alpha * m0[i][k] + (1 - double{c.h.alpha}) * gk;
        v[k] = c.h.beta * v0[i][k] + (1 - double{c.h.beta}) * gk * gk;
      }
      std::vector<double> stored[2];
      for (bool first : {true, false}) {
        const std::vector<double> codes = t.codes(i, first), absmax = (first ? t.am : t.av)[i].read();
        expect_encoded(first ? m : v, codes, absmax, first, what, bits());
        stored[first ? 0 : 1] = reference_decode(codes, absmax, first, bits());
      }
      double w2 = 0, d2 = 0;
      std::vector<double> d(n);
      for (size_t k = 0; k < n; ++k) {
        d[k] = (stored[0][k] / bias1) / (std::sqrt(stored[1][k] / bias2) + c.h.epsilon) + c.h.lambda * w0[i][k];
        w2 += w0[i][k] * w0[i][k];
        d2 += d[k] * d[k];
      }
      const double ratio = std::clamp(std::sqrt(w2) / std::sqrt(d2), double{c.h.ratio_min}, double{c.h.ratio_max});
      std::vector<double> want_w(n);
      for (size_t k = 0; k < n; ++k) want_w[k] = w0[i][k] - 0.01 * ratio * d[k];
      if (c.update) {
        // The delta is w_new - w in f32: it carries w_new's rounding, which
        // is small against w, not against the delta; so w + delta is compared.
        const std::vector<double> delta = t.update[i].read();
        std::vector<double> got_w(n);
        for (size_t k = 0; k < n; ++k) got_w[k] = w0[i][k] + delta[k];
        EXPECT_LE(relative_error(got_w, want_w), optimizer_tolerance(DType::f32, 1)) << what << " (update)";
        EXPECT_EQ(t.w[i].read(), w0[i]) << what << " (weights left)";
      } else {
        EXPECT_LE(relative_error(t.w[i].read(), want_w), optimizer_tolerance(DType::f32, 1)) << what << " (weights)";
      }
      if (c.copy != DType::f32) {
        EXPECT_EQ(t.copy[i].read(), round_to(c.copy, t.w[i].read())) << what << " (copy)";
      }
    }
  }
}

// Over many steps the low-bit moments follow the f32 ones: after 50 steps the
// weights' movement differs by 4.7% with 8-bit moments and by 46-48% with
// 4-bit ones (measured; Adam's 4-bit: 26%, test_adam_low_bit.cc): 16 codes
// over three decades, and LAMB's direction m / sqrt(v) carries both errors.
TEST_P(LambLowBit, ManyStepsFollowTheF32MomentPath) {
  const Config c = configs()[0];
  const std::vector<int64_t> sizes = {65536 + 1000, 3000};
  Tensors eight = make(c, 11, sizes);
  std::vector<TestTensor> w32, m32, v32;
  std::vector<std::vector<double>> w0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    w0.push_back(eight.w[i].read());
    w32.emplace_back(device(), DType::f32, w0.back());
    m32.emplace_back(device(), DType::f32, eight.decoded(i, true));
    v32.emplace_back(device(), DType::f32, eight.decoded(i, false));
  }
  const auto w32v = views(w32), m32v = views(m32), v32v = views(v32);
  const LambPlan p8(eight.tensors(), std::span(&c.h, 1));
  const LambPlan p32(LambTensors{w32v, eight.gv, m32v, v32v, {}, {}}, std::span(&c.h, 1));
  std::mt19937_64 rng(12);
  std::normal_distribution<double> noise(0.0, 1.0);
  for (int step = 1; step <= 50; ++step) {
    // A steady direction per element plus noise, as training has.
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::vector<double> grad(sizes[i]);
      for (int64_t k = 0; k < sizes[i]; ++k) grad[k] = 0.01 * w0[i][k] + 0.005 * noise(rng);
      const TestTensor fresh(device(), DType::f32, grad);
      copy_from_host(eight.g[i].view().data, device(), fresh.bytes().data(), fresh.bytes().size());
    }
    p8.step(inputs(c, step));
    p32.step(inputs(c, step));
  }
  synchronize(device());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<double> a = eight.w[i].read(), b = w32[i].read();
    double diff = 0, moved = 0;
    for (int64_t k = 0; k < sizes[i]; ++k) {
      diff += (a[k] - b[k]) * (a[k] - b[k]);
      moved += (b[k] - w0[i][k]) * (b[k] - w0[i][k]);
    }
    EXPECT_LT(std::sqrt(diff / moved), bits() == 4 ? 0.6 : 0.1) << "tensor " << i;
  }
}

// The step in two calls (pass 1 writing its sums, pass 2 reading them as one
// row) is the whole step bit for bit.
TEST_P(LambLowBit, SplitStepEqualsTheWholeStep) {
  for (const Config& c : configs()) {
    Tensors whole = make(c, 21), split = make(c, 21);
    const LambPlan pw(whole.tensors(), std::span(&c.h, 1)), ps(split.tensors(), std::span(&c.h, 1));
    const size_t n = whole.w.size();
    std::vector<int32_t> index(n);
    for (size_t i = 0; i < n; ++i) index[i] = static_cast<int32_t>(n - 1 - i);  // any order
    Buffer index_buffer(device(), n * sizeof(int32_t)), sums(device(), 2 * n * sizeof(double));
    copy_from_host(index_buffer.data(), device(), index.data(), n * sizeof(int32_t));
    std::mt19937_64 ga(22), gb(22);
    for (int step = 1; step <= 3; ++step) {
      whole.new_gradients(ga, c.grad, c.loss_scale);
      split.new_gradients(gb, c.grad, c.loss_scale);
      pw.step(inputs(c, step));
      LambStepInputs in = inputs(c, step);
      in.split = {LambPass::first, static_cast<double*>(sums.data()), static_cast<const int32_t*>(index_buffer.data())};
      ps.step(in);
      in.split.pass = LambPass::second;
      ps.step(in);
    }
    synchronize(device());
    EXPECT_EQ(whole.bytes(), split.bytes()) << c.name;
  }
}

// A NaN gradient (not caught by found_inf): its block keeps its codes,
// absmax and weights (the mark is cleared by pass 2), no Inf or NaN is
// stored, and every other block's moments are those of a clean run.
TEST_P(LambLowBit, ANonFiniteDirectionKeepsItsWholeBlock) {
  const Config c = configs()[0];
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    Tensors t = make(c, 31), clean = make(c, 31);
    const size_t i = 3;  // past a chunk: 258 blocks of 256, or 515 of 128
    const int block = static_cast<int>(quant_block_of(bits()));
    std::vector<double> grad = t.g[i].read();
    grad[block + 44] = bad;  // block 1
    t.g[i] = TestTensor(device(), DType::f32, grad);
    t.refresh();
    const auto codes_m = t.codes(i, true), codes_v = t.codes(i, false), am = t.am[i].read(), av = t.av[i].read();
    const auto w = t.w[i].read();
    LambPlan(t.tensors(), std::span(&c.h, 1)).step(inputs(c, 1));
    LambPlan(clean.tensors(), std::span(&c.h, 1)).step(inputs(c, 1));
    synchronize(device());
    const auto new_am = t.am[i].read(), new_av = t.av[i].read(), clean_am = clean.am[i].read(),
               clean_av = clean.av[i].read();
    const auto new_m = t.codes(i, true), new_v = t.codes(i, false), clean_m = clean.codes(i, true),
               clean_v = clean.codes(i, false);
    const auto new_w = t.w[i].read();
    EXPECT_EQ(new_am[1], am[1]);
    EXPECT_FALSE(std::signbit(new_am[1])) << "the mark is cleared";
    EXPECT_EQ(new_av[1], av[1]);
    for (int k = block; k < 2 * block; ++k) {
      ASSERT_EQ(new_m[k], codes_m[k]) << k;
      ASSERT_EQ(new_v[k], codes_v[k]) << k;
      ASSERT_EQ(new_w[k], w[k]) << k;
    }
    for (size_t b = 0; b < new_am.size(); ++b) {
      ASSERT_TRUE(std::isfinite(new_am[b]) && std::isfinite(new_av[b])) << "block " << b;
      if (b != 1) ASSERT_EQ(new_am[b], clean_am[b]) << "block " << b;
      if (b != 1) ASSERT_EQ(new_av[b], clean_av[b]) << "block " << b;
    }
    // Pass 1 encodes every other block before any ratio: its codes are the clean run's.
    for (size_t k = 0; k < new_m.size(); ++k) {
      if (k / block == 1) continue;
      ASSERT_EQ(new_m[k], clean_m[k]) << k;
      ASSERT_EQ(new_v[k], clean_v[k]) << k;
    }
    for (double x : new_w) ASSERT_TRUE(std::isfinite(x));
    EXPECT_NE(new_w[0], w[0]) << "other blocks still move";
  }
}

TEST_P(LambLowBit, SkippedStepsWriteNothing) {
  const Config c = configs()[1];
  Tensors t = make(c, 41);
  const auto before = t.bytes();
  const LambPlan plan(t.tensors(), std::span(&c.h, 1));
  TestFlag found(device(), true), no_update(device(), false);
  LambStepInputs in = inputs(c, 1);
  in.found_inf = found.pointer();
  plan.step(in);
  in = inputs(c, 1);
  in.do_update = Flag::device(no_update.pointer());
  plan.step(in);
  in = inputs(c, 1);
  in.do_update = Flag::host(false);
  plan.step(in);
  synchronize(device());
  EXPECT_EQ(t.bytes(), before);
}

TEST_P(LambLowBit, BitwiseDeterministic) {
  for (const Config& c : configs()) {
    Tensors a = make(c, 51), b = make(c, 51);
    for (int step = 1; step <= 3; ++step) {
      LambPlan(a.tensors(), std::span(&c.h, 1)).step(inputs(c, step));
      LambPlan(b.tensors(), std::span(&c.h, 1)).step(inputs(c, step));
    }
    synchronize(device());
    EXPECT_EQ(a.bytes(), b.bytes()) << c.name;
  }
}

TEST_P(LambLowBit, RejectsBadArgumentsNamingThem) {
  const Config c = configs()[0];
  Tensors t = make(c, 61);
  const auto before = t.bytes();
  const LambTensors x = t.tensors();
  auto plan = [&](const LambTensors& tensors) { LambPlan(tensors, std::span(&c.h, 1)); };

  LambTensors missing = x;
  missing.exp_avg_absmax = {};
  expect_error([&] { plan(missing); }, ErrorCode::size_mismatch, {"lamb_step", "exp_avg_absmax", "exp_avg is u8"});

  std::vector<TensorView> wrong_blocks = t.avv;
  wrong_blocks[3].numel -= 1;
  LambTensors blocks = x;
  blocks.exp_avg_sq_absmax = wrong_blocks;
  expect_error([&] { plan(blocks); }, ErrorCode::size_mismatch, {"exp_avg_sq_absmax[3]"});

  // f32 stand-ins as long as the codes (4-bit: half the elements), so that the dtype is what is wrong.
  std::vector<TestTensor> f32, f32_whole;
  for (const TestTensor& codes : t.v) f32.emplace_back(device(), DType::f32, std::vector<double>(codes.numel(), 0.0));
  for (int64_t n : sizes_of(bits())) f32_whole.emplace_back(device(), DType::f32, std::vector<double>(n, 0.0));
  const auto f32v = views(f32), f32_wholev = views(f32_whole);
  LambTensors mixed = x;
  mixed.exp_avg_sq = f32v;
  expect_error([&] { plan(mixed); }, ErrorCode::dtype_unsupported, {"exp_avg_sq", "u8"});

  LambTensors stray = x;
  stray.exp_avg = f32_wholev;
  stray.exp_avg_sq = f32_wholev;
  stray.moment_bits = 8;
  expect_error([&] { plan(stray); }, ErrorCode::invalid_argument, {"exp_avg_absmax", "not u8"});
  stray.exp_avg_absmax = stray.exp_avg_sq_absmax = {};
  stray.moment_bits = 4;
  expect_error([&] { plan(stray); }, ErrorCode::invalid_argument, {"moment_bits", "is 4 with exp_avg not u8"});
  LambTensors odd = x;
  odd.moment_bits = 2;
  expect_error([&] { plan(odd); }, ErrorCode::invalid_argument, {"moment_bits", "expected 8 or 4"});

  std::vector<TestTensor> f64, f64_grads;
  for (int64_t n : sizes_of(bits())) f64.emplace_back(device(), DType::f64, std::vector<double>(n, 0.0));
  for (int64_t n : sizes_of(bits())) f64_grads.emplace_back(device(), DType::f64, std::vector<double>(n, 1.0));
  LambTensors f64_weights = x;
  const auto f64v = views(f64);
  f64_weights.weights = f64v;
  const auto f64g = views(f64_grads);
  f64_weights.grads = f64g;
  expect_error([&] { plan(f64_weights); }, ErrorCode::dtype_unsupported, {"exp_avg", "f64"});
  EXPECT_EQ(t.bytes(), before);
}

INSTANTIATE_TEST_SUITE_P(DevicesAndBits, LambLowBit,
                         devices_and_bits(),
                         low_bit_test_name);

// The owning Lamb with 8- and 4-bit moments (support/low_bit_checks.h): a resumed
// run equals the straight one bit for bit, and the state is what the form
// promises per parameter (4-bit: 1.06 plus each tensor's alignment, 1.10 on
// this small model, as Adam's).
LambGroup owning_group() {
  LambGroup group;
  group.hyperparameters.lambda = 0.01f;
  return group;
}

using LambLowBitOptimizer = LambLowBit;

TEST_P(LambLowBitOptimizer, ResumeFromACheckpointEqualsTheStraightRun) {
  const LambOptions options{.eta = 0.01f, .moment_dtype = DType::u8, .moment_bits = bits()};
  if (bits() == 8) return expect_resumed_run_equals_straight_run<Lamb>(device(), owning_group(), options);
  expect_resumed_run_equals_straight_run<Lamb>(device(), owning_group(), options,
                                               {1.11, quant4_bytes(70001), quant4_blocks(70001)});
}

TEST_P(LambLowBitOptimizer, RejectsWhatItCannotStore) {
  OwningModel model(device(), 9);
  expect_error([&] { Lamb(model.groups(owning_group()), {.moment_dtype = DType::i16}); }, ErrorCode::dtype_unsupported,
               {"options.moment_dtype", "f32, bf16 or u8"});
  expect_error([&] { Lamb(model.groups(owning_group()), {.moment_dtype = DType::f32, .moment_bits = 4}); },
               ErrorCode::invalid_argument, {"options.moment_bits", "u8"});
  expect_error([&] { Lamb(model.groups(owning_group()), {.moment_dtype = DType::u8, .moment_bits = 2}); },
               ErrorCode::invalid_argument, {"options.moment_bits", "expected 8 or 4"});
}

// An 8-bit file does not load into a 4-bit Lamb, nor the other way, naming
// the moments, and nothing is written.
TEST_P(LambLowBitOptimizer, EachFormLoadsOnlyItsOwnFile) {
  OwningModel model(device(), 5);
  const int other = bits() == 8 ? 4 : 8;
  Lamb mine(model.groups(owning_group()), {.eta = 0.01f, .moment_dtype = DType::u8, .moment_bits = bits()});
  Lamb theirs(model.groups(owning_group()), {.eta = 0.01f, .moment_dtype = DType::u8, .moment_bits = other});
  std::mt19937_64 rng(6);
  model.new_gradients(rng);
  mine.step();
  theirs.step();
  const std::string path = ::testing::TempDir() + "gradkit_lamb_form_" + std::to_string(::getpid());
  theirs.save(path);
  const auto before = moment_state(mine);
  expect_error([&] { mine.load(path); }, ErrorCode::io_error,
               {path, other == 4 ? "u4 (4-bit moments)" : "u8 (8-bit moments)",
                bits() == 4 ? "expected u4" : "expected u8"});
  EXPECT_EQ(moment_state(mine), before);
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(DevicesAndBits, LambLowBitOptimizer,
                         devices_and_bits(),
                         low_bit_test_name);

// The same steps on the CPU and on CUDA give the same bytes: weights (or
// deltas), copies, codes, absmax; whole steps and split ones, and two NaNs.
class LambLowBitBackends : public ::testing::TestWithParam<int> {};

TEST_P(LambLowBitBackends, CpuAndCudaAgreeBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  for (const Config& c : configs()) {
    for (bool split : {false, true}) {
      std::vector<std::vector<std::vector<uint8_t>>> results;
      for (Device device : {Device::cpu(), Device::cuda(0)}) {
        Tensors t(device, c, 81, GetParam());
        // A NaN in tensor 3's first chunk, and one in tensor 5's last whole
        // span (its span 12, before the short one).
        std::vector<double> grad = t.g[3].read();
        grad[70] = std::numeric_limits<double>::quiet_NaN();
        t.g[3] = TestTensor(device, c.grad, grad);
        std::vector<double> grad5 = t.g[5].read();
        grad5[12 * 256 + 3] = std::numeric_limits<double>::quiet_NaN();
        t.g[5] = TestTensor(device, c.grad, grad5);
        t.refresh();
        const LambPlan plan(t.tensors(), std::span(&c.h, 1));
        const size_t n = t.w.size();
        std::vector<int32_t> index(n);
        for (size_t i = 0; i < n; ++i) index[i] = static_cast<int32_t>(i);
        Buffer index_buffer(device, n * sizeof(int32_t)), sums(device, 2 * n * sizeof(double));
        copy_from_host(index_buffer.data(), device, index.data(), n * sizeof(int32_t));
        for (int step = 1; step <= 20; ++step) {
          LambStepInputs in = inputs(c, step);
          if (!split) {
            plan.step(in);
            continue;
          }
          in.split = {LambPass::first, static_cast<double*>(sums.data()), static_cast<const int32_t*>(index_buffer.data())};
          plan.step(in);
          in.split.pass = LambPass::second;
          plan.step(in);
        }
        synchronize(device);
        results.push_back(t.bytes());
      }
      EXPECT_EQ(results[0], results[1]) << c.name << (split ? " split" : "");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Bits, LambLowBitBackends, ::testing::Values(8, 4),
                         bits_test_name);

}  // namespace
}  // namespace gradkit::test
