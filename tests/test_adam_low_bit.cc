// adam_step with 8- and 4-bit blockwise moments on every backend, the same
// checks for both forms: one step against a float64 reference (decode,
// update, encode) within one code, many steps beside the f32 moments, a
// small gradient beside a large one, skipped and non-finite steps,
// determinism; and the CPU and CUDA backends bit for bit. What only one form
// has (its tables, its encoders, its bad arguments, its owning optimizer)
// is in test_adam_low_bit_int8.cc and test_adam_low_bit_int4.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/low_bit.h"
#include "support/adam_reference.h"
#include "support/low_bit_checks.h"
#include "support/low_bit_adam.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

// Each form's tensors: sizes with a short last block, a tensor of one
// element and one past a chunk (4-bit: odd sizes, so that a last byte holds
// one code), and moments spanning the decades its map covers. 8-bit: also
// 13 whole spans of 256 and a short one, which the CUDA kernel reads as a
// round of 8 spans through shared memory, a part round (of 5, or of 4 where
// a round's absmax come with it), then the rest from the lists
// (cuda/adam_low_bit.cu, update_staged).
LowBitTensors tensors_for(int bits, Device device, const AdamConfig& c, uint64_t seed) {
  if (bits == 4) return LowBitTensors(device, c, seed, 4, {1, 127, 128 + 7, 65536 + 301, 1001}, 2, 1);
  return LowBitTensors(device, c, seed, 8, {1, 255, 256 + 7, 65536 + 300, 1000, 13 * 256 + 5}, 4, 4);
}

class AdamLowBit : public ::testing::TestWithParam<std::tuple<Device, int>> {
 protected:
  void SetUp() override {
    if (device().is_cuda() && !cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
  Device device() const { return std::get<0>(GetParam()); }
  int bits() const { return std::get<1>(GetParam()); }
  LowBitTensors make(const AdamConfig& c, uint64_t seed) const { return tensors_for(bits(), device(), c, seed); }
};

// Decode, update in f64, encode in f64: the kernel's absmax agrees to f32
// rounding, its codes are the reference's or a neighbour (f32 arithmetic may
// land on the other side of a decision point), its weights agree to f32
// rounding (they are updated from the f32 moments, before encoding).
TEST_P(AdamLowBit, OneStepMatchesTheReferenceWithinOneCode) {
  uint64_t seed = 40;
  for (const AdamConfig& c : low_bit_configs()) {
    LowBitTensors t = make(c, seed++);
    const int64_t step = 5;
    std::vector<AdamReferenceState> ref;
    for (size_t i = 0; i < t.w.size(); ++i) ref.push_back({t.masters(i), t.decoded(i, true), t.decoded(i, false), {}});
    AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = step, .grad_scale = c.grad_scale});
    synchronize(device());
    for (size_t i = 0; i < t.w.size(); ++i) {
      const std::string what = c.name + " tensor " + std::to_string(i);
      reference_adam_step(ref[i], t.g[i].read(), c.h, step, c.grad_scale, DType::f64, DType::f64);
      EXPECT_LE(relative_error(t.masters(i), ref[i].w), optimizer_tolerance(DType::f32, 1)) << what << " (weights)";
      for (bool first : {true, false}) {
        expect_encoded(first ? ref[i].m : ref[i].v, t.codes(i, first), (first ? t.am : t.av)[i].read(), first, what,
                       bits());
      }
      if (c.copy != DType::f32) EXPECT_EQ(t.copy[i].read(), round_to(DType::bf16, t.w[i].read())) << what << " (copy)";
    }
  }
}

// Over many steps the low-bit moments follow the f32 moments' path: the
// weights' movement differs by a few percent with 8-bit moments (the codes'
// relative spacing), by about a quarter with 4-bit ones (0.26 measured on
// this case, 0.018 with 8-bit: 16 codes over three decades; docs/ops.md,
// "4-bit moments").
TEST_P(AdamLowBit, ManyStepsFollowTheF32MomentPath) {
  std::mt19937_64 rng(5);
  const int64_t n = 65536 + 1001;
  const std::vector<double> w0 = round_to(DType::f32, random_values(rng, n));
  const int64_t bytes = bits() == 4 ? quant4_bytes(n) : n, blocks = bits() == 4 ? quant4_blocks(n) : quant_blocks(n);
  TestTensor wq(device(), DType::f32, w0), w32(device(), DType::f32, w0), g(device(), DType::f32, w0);
  // Zero moments: the codes of 0 (with an absmax of 0 any code decodes to 0).
  TestTensor q_m(device(), DType::u8, std::vector<double>(bytes, 0)), q_v(device(), DType::u8, std::vector<double>(bytes, 0));
  TestTensor am(device(), DType::f32, std::vector<double>(blocks, 0)), av(device(), DType::f32, std::vector<double>(blocks, 0));
  TestTensor m(device(), DType::f32, std::vector<double>(n, 0)), v(device(), DType::f32, std::vector<double>(n, 0));
  const TensorView WQ[] = {wq.view()}, W32[] = {w32.view()}, G[] = {g.view()}, QM[] = {q_m.view()}, QV[] = {q_v.view()},
                   AM[] = {am.view()}, AV[] = {av.view()}, M[] = {m.view()}, V[] = {v.view()};
  AdamHyperparameters h;
  h.lr = 1e-3f;
  AdamTensors low_bit{WQ, G, QM, QV, {}, {}, AM, AV, {}};
  low_bit.moment_bits = bits();
  const AdamPlan low(low_bit, std::span(&h, 1)), full({W32, G, M, V, {}, {}}, std::span(&h, 1));
  std::normal_distribution<double> noise(0.0, 1.0);
  for (int step = 1; step <= 50; ++step) {
    // A gradient with a steady direction per element plus noise, as training has.
    std::vector<double> grad(n);
    for (int64_t k = 0; k < n; ++k) grad[k] = 0.01 * w0[k] + 0.005 * noise(rng);
    const TestTensor fresh(device(), DType::f32, grad);
    copy_from_host(g.view().data, device(), fresh.bytes().data(), fresh.bytes().size());
    low.step({.step = step});
    full.step({.step = step});
  }
  synchronize(device());
  const std::vector<double> a = wq.read(), b = w32.read();
  double diff = 0, moved = 0;
  for (int64_t k = 0; k < n; ++k) {
    diff += (a[k] - b[k]) * (a[k] - b[k]);
    moved += (b[k] - w0[k]) * (b[k] - w0[k]);
  }
  EXPECT_LT(std::sqrt(diff / moved), bits() == 4 ? 0.35 : 0.05);
}

// A small gradient in a block beside a large one: with a steady gradient
// Adam steps each weight by about lr. Were the small element's v (1e-8 of
// the block's absmax) encoded as 0, its history would be lost each step
// while its m kept it, and its steps would grow to several lr (a run of
// gradkit train diverged so). The 8-bit unsigned map's positive floor keeps
// it; the 4-bit map has no zero (its v is stored as at least 0.00325 of
// the absmax, which only shortens its step).
TEST_P(AdamLowBit, ASmallGradientBesideALargeOneStepsNoFurtherThanLr) {
  const int64_t n = bits() == 4 ? kQuant4Block : kQuantBlock;
  const int64_t bytes = bits() == 4 ? quant4_bytes(n) : n;
  std::vector<double> grad(n, 1e-4);
  grad[0] = 1.0;
  TestTensor w(device(), DType::f32, std::vector<double>(n, 0.5)), g(device(), DType::f32, grad);
  TestTensor qm(device(), DType::u8, std::vector<double>(bytes, 0)), qv(device(), DType::u8, std::vector<double>(bytes, 0));
  TestTensor am(device(), DType::f32, {0.0}), av(device(), DType::f32, {0.0});
  const TensorView W[] = {w.view()}, G[] = {g.view()}, QM[] = {qm.view()}, QV[] = {qv.view()}, AM[] = {am.view()},
                   AV[] = {av.view()};
  AdamHyperparameters h;
  h.lr = 1e-3f;
  AdamTensors t{W, G, QM, QV, {}, {}, AM, AV, {}};
  t.moment_bits = bits();
  const AdamPlan plan(t, std::span(&h, 1));
  std::vector<double> before = w.read();
  for (int step = 1; step <= 40; ++step) {
    plan.step({.step = step});
    const std::vector<double> after = w.read();
    for (int64_t k = 0; k < n; ++k) ASSERT_LE(std::abs(after[k] - before[k]), 1.5 * h.lr) << "step " << step << " element " << k;
    before = after;
  }
  if (bits() == 8) {
    const std::vector<double> codes = qv.read();
    for (int64_t k = 1; k < n; ++k) ASSERT_GE(codes[k], 1) << "a positive v keeps a positive code";
  }
}

TEST_P(AdamLowBit, FoundInfSkipsTheWholeStep) {
  const AdamConfig c = low_bit_configs()[0];
  LowBitTensors t = make(c, 3);
  const auto before = t.bytes();
  TestFlag found(device(), true);
  AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = 1, .found_inf = found.pointer()});
  synchronize(device());
  EXPECT_EQ(t.bytes(), before);
}

// Without found_inf, a NaN gradient makes its element's weight NaN and its
// block's absmax NaN (the whole block then decodes to NaN); other blocks
// and tensors are untouched by it.
TEST_P(AdamLowBit, ANanGradientPoisonsOnlyItsBlock) {
  const AdamConfig c = low_bit_configs()[0];
  LowBitTensors t = make(c, 4), clean = make(c, 4);
  const size_t i = 3;  // past a chunk
  const int64_t element = 300, poisoned = element / t.block();
  std::vector<double> grad = t.g[i].read();
  grad[element] = std::numeric_limits<double>::quiet_NaN();
  t.g[i] = TestTensor(device(), DType::f32, grad);
  t.refresh_views();
  AdamPlan(t.tensors(c), std::span(&c.h, 1)).step({.step = 1});
  AdamPlan(clean.tensors(c), std::span(&c.h, 1)).step({.step = 1});
  synchronize(device());
  const auto am = t.am[i].read(), clean_am = clean.am[i].read();
  EXPECT_TRUE(std::isnan(am[poisoned]));
  EXPECT_TRUE(std::isnan(t.w[i].read()[element]));
  for (size_t b = 0; b < am.size(); ++b) {
    if (static_cast<int64_t>(b) != poisoned) ASSERT_EQ(am[b], clean_am[b]) << "block " << b;
  }
  EXPECT_EQ(t.m[0].bytes(), clean.m[0].bytes());
}

TEST_P(AdamLowBit, BitwiseDeterministic) {
  for (const AdamConfig& c : low_bit_configs()) {
    LowBitTensors a = make(c, 9), b = make(c, 9);
    for (int step = 1; step <= 3; ++step) {
      AdamPlan(a.tensors(c), std::span(&c.h, 1)).step({.step = step});
      AdamPlan(b.tensors(c), std::span(&c.h, 1)).step({.step = step});
    }
    synchronize(device());
    EXPECT_EQ(a.bytes(), b.bytes()) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(DevicesAndBits, AdamLowBit,
                         devices_and_bits(),
                         low_bit_test_name);

// The same steps on the CPU and on CUDA give the same bytes: weights,
// remainders, copies, codes, absmax.
class AdamLowBitBackends : public ::testing::TestWithParam<int> {};

TEST_P(AdamLowBitBackends, CpuAndCudaAgreeBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  for (const AdamConfig& c : low_bit_configs()) {
    LowBitTensors cpu = tensors_for(GetParam(), Device::cpu(), c, 77), gpu = tensors_for(GetParam(), Device::cuda(0), c, 77);
    const AdamPlan on_cpu(cpu.tensors(c), std::span(&c.h, 1)), on_gpu(gpu.tensors(c), std::span(&c.h, 1));
    for (int step = 1; step <= 20; ++step) {
      on_cpu.step({.step = step, .grad_scale = c.grad_scale});
      on_gpu.step({.step = step, .grad_scale = c.grad_scale});
    }
    synchronize(Device::cuda(0));
    EXPECT_EQ(cpu.bytes(), gpu.bytes()) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Bits, AdamLowBitBackends, ::testing::Values(8, 4),
                         bits_test_name);

}  // namespace
}  // namespace gradkit::test
