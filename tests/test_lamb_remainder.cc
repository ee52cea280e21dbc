// lamb_step / LambPlan with remainder masters (bf16 weights plus an i16
// weight_remainder, docs/ops.md "the remainder master"): the master equals
// the f32-master LAMB's master bit for bit over 100 steps fed the same
// seeded gradients (with loss scaling, clipping, two groups and a non-finite
// gradient element), follows the float64 reference, runs in two calls
// (split) as in one, and every combination that cannot work is refused
// naming the argument, with nothing written.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/lamb.h"
#include "gradkit/ops/master.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/lamb_reference.h"
#include "support/master_weights.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

const std::vector<int64_t> kSizes = {7, 65536 + 300, 1000, 4096 + 3};

template <class T>
std::vector<T> as(const std::vector<uint8_t>& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

std::vector<TensorView> views(const std::vector<TestTensor>& ts) {
  std::vector<TensorView> out;
  for (const auto& t : ts) out.push_back(t.view());
  return out;
}

// One LAMB's tensors: the weights in either form (support/master_weights.h)
// and moments of dtype `moments`, starting at zero.
struct State : MasterWeights {
  std::vector<TestTensor> m, v;
  State(Device device, const std::vector<std::vector<double>>& masters, bool remainder, DType moments)
      : MasterWeights(device, masters, remainder) {
    for (const auto& x : masters) {
      m.emplace_back(device, moments, std::vector<double>(x.size(), 0.0));
      v.emplace_back(device, moments, std::vector<double>(x.size(), 0.0));
    }
  }
  // Each tensor's f32 master bits.
  std::vector<std::vector<uint32_t>> masters() const {
    std::vector<std::vector<uint32_t>> out;
    for (size_t i = 0; i < w.size(); ++i) out.push_back(master_bits(i));
    return out;
  }
  std::vector<double> master_values(size_t i) const {
    std::vector<double> out;
    for (uint32_t bits : master_bits(i)) out.push_back(std::bit_cast<float>(bits));
    return out;
  }
};

// Seeded bf16 gradients written into `g` (the same memory: plans stay valid);
// returns them as float64. `poison` >= 0 puts an Inf at that element of tensor 1.
std::vector<std::vector<double>> feed(std::vector<TestTensor>& g, std::mt19937_64& rng, int64_t poison = -1) {
  std::vector<std::vector<double>> out;
  for (size_t i = 0; i < g.size(); ++i) {
    auto values = round_to(DType::bf16, random_values(rng, g[i].numel()));
    if (i == 1 && poison >= 0) values[poison] = INFINITY;
    const TestTensor fresh(g[i].view().device, DType::bf16, values);
    copy_from_host(g[i].view().data, g[i].view().device, fresh.bytes().data(), fresh.bytes().size());
    out.push_back(values);
  }
  return out;
}

std::vector<std::vector<double>> initial_masters(std::mt19937_64& rng) {
  std::vector<std::vector<double>> out;
  for (int64_t n : kSizes) out.push_back(round_to(DType::f32, random_values(rng, n)));
  return out;
}

std::vector<LambHyperparameters> two_groups() {
  std::vector<LambHyperparameters> h(2);
  h[0].lambda = 0.01f;
  h[1].lambda = 0.1f;
  h[1].ratio_min = 0.05f;
  h[1].ratio_max = 0.5f;
  return h;
}
const std::vector<int32_t> kGroups = {0, 1, 0, 1};

using RemainderLamb = OnEachDevice;

// Same masters, same gradients: (weight, remainder) keeps the f32 path's
// masters and moments bit for bit over 100 steps, loss-scaled and clipped,
// with an Inf gradient element at step 30 (that element keeps its master and
// moments on both paths). Its weights are the masters rounded to nearest
// with ties away from zero, the f32 path's copy the same masters rounded to
// nearest even: they differ exactly where a master's low 16 bits are 0x8000.
TEST_P(RemainderLamb, KeepsTheF32MasterPathsMastersBitForBitOver100Steps) {
  for (DType moments : {DType::f32, DType::bf16}) {
    std::mt19937_64 rng(31);
    const auto init = initial_masters(rng);
    State f32(device(), init, false, moments), pair(device(), init, true, moments);
    std::vector<TestTensor> g;
    for (int64_t n : kSizes) g.emplace_back(device(), DType::bf16, std::vector<double>(n, 0.5));
    const auto gv = views(g), fw = views(f32.w), fc = views(f32.copy), fm = views(f32.m), fv = views(f32.v);
    const auto pw = views(pair.w), pr = views(pair.rem), pm = views(pair.m), pv = views(pair.v);
    LambTensors a{fw, gv, fm, fv, fc}, b{pw, gv, pm, pv};
    b.weight_remainder = pr;
    const auto h = two_groups();
    const LambPlan plan_a(a, h, kGroups), plan_b(b, h, kGroups);
    EXPECT_TRUE(plan_b.has_weight_remainder());
    EXPECT_FALSE(plan_a.has_weight_remainder());
    for (int step = 1; step <= 100; ++step) {
      feed(g, rng, step == 30 ? 4321 : -1);
      LambStepInputs in;
      in.eta = 1e-2f;
      in.loss_scale = 64.0f;
      in.gradient_norm = step % 3 == 0 ? 64.0f * 500.0f : -1.0f;  // every third step clipped
      in.step = step;
      plan_a.step(in);
      plan_b.step(in);
      synchronize(device());
      const auto ma = f32.masters(), mb = pair.masters();
      for (size_t i = 0; i < kSizes.size(); ++i) {
        ASSERT_EQ(ma[i], mb[i]) << dtype_name(moments) << " moments, step " << step << ", tensor " << i;
        ASSERT_EQ(f32.m[i].bytes(), pair.m[i].bytes()) << "exp_avg, step " << step;
        ASSERT_EQ(f32.v[i].bytes(), pair.v[i].bytes()) << "exp_avg_sq, step " << step;
        const auto copy = as<uint16_t>(f32.copy[i].bytes()), weights = as<uint16_t>(pair.w[i].bytes());
        for (size_t k = 0; k < copy.size(); ++k) {
          const uint32_t master = ma[i][k];
          if ((master & 0xffffu) != 0x8000u) ASSERT_EQ(weights[k], copy[k]) << "element " << k << ", step " << step;
          else ASSERT_EQ(weights[k], static_cast<uint16_t>((master + 0x8000u) >> 16)) << "a tie, away from zero";
        }
      }
      if (step == 30) {  // the Inf element kept its master (step 29's) on both paths
        ASSERT_TRUE(std::isfinite(std::bit_cast<float>(mb[1][4321])));
      }
    }
  }
}

// The remainder path against the float64 reference (docs/ops.md), f32
// moments, 20 steps: the same bound as the f32-master path's test.
TEST_P(RemainderLamb, MatchesTheFloat64ReferenceOver20Steps) {
  std::mt19937_64 rng(41);
  const auto init = initial_masters(rng);
  State pair(device(), init, true, DType::f32);
  std::vector<TestTensor> g;
  for (int64_t n : kSizes) g.emplace_back(device(), DType::bf16, std::vector<double>(n, 0.5));
  const auto gv = views(g), pw = views(pair.w), pr = views(pair.rem), pm = views(pair.m), pv = views(pair.v);
  LambTensors t{pw, gv, pm, pv};
  t.weight_remainder = pr;
  const auto h = two_groups();
  const LambPlan plan(t, h, kGroups);
  std::vector<LambReferenceState> ref;
  for (const auto& x : init) ref.push_back({x, std::vector<double>(x.size(), 0.0), std::vector<double>(x.size(), 0.0), {}});
  constexpr int kSteps = 20;
  for (int step = 1; step <= kSteps; ++step) {
    const auto grads = feed(g, rng);
    plan.step({.eta = 1e-2f, .loss_scale = 8.0f, .step = step});
    LambReferenceInputs rin;
    rin.eta = 1e-2;
    rin.loss_scale = 8.0;
    rin.step = step;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      reference_lamb_step(ref[i], grads[i], h[kGroups[i]], rin, DType::f32, DType::f32);
    }
  }
  synchronize(device());
  for (size_t i = 0; i < kSizes.size(); ++i) {
    EXPECT_LE(relative_error(pair.master_values(i), ref[i].w), optimizer_tolerance(DType::f32, kSteps)) << i;
    EXPECT_LE(relative_error(pair.m[i].read(), ref[i].m), 4 * optimizer_tolerance(DType::f32, kSteps)) << i;
    EXPECT_LE(relative_error(pair.v[i].read(), ref[i].v), 4 * optimizer_tolerance(DType::f32, kSteps)) << i;
  }
}

// A step in two calls (split first, then second over one row) is the
// one-call step bit for bit: masters, weights, remainders and moments.
TEST_P(RemainderLamb, TwoCallsEqualOneCall) {
  std::mt19937_64 rng(51);
  const auto init = initial_masters(rng);
  State whole(device(), init, true, DType::f32), split(device(), init, true, DType::f32);
  std::vector<TestTensor> g;
  for (int64_t n : kSizes) g.emplace_back(device(), DType::bf16, std::vector<double>(n, 0.5));
  const auto gv = views(g);
  const auto ww = views(whole.w), wr = views(whole.rem), wm = views(whole.m), wv = views(whole.v);
  const auto sw = views(split.w), sr = views(split.rem), sm = views(split.m), sv = views(split.v);
  LambTensors a{ww, gv, wm, wv}, b{sw, gv, sm, sv};
  a.weight_remainder = wr;
  b.weight_remainder = sr;
  const auto h = two_groups();
  const LambPlan plan_a(a, h, kGroups), plan_b(b, h, kGroups);
  const int n = static_cast<int>(kSizes.size());
  Buffer sums(device(), 2 * n * sizeof(double)), index(device(), n * sizeof(int32_t));
  std::vector<int32_t> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  copy_from_host(index.data(), device(), order.data(), order.size() * sizeof(int32_t));
  auto* sums_at = static_cast<double*>(sums.data());
  const auto* index_at = static_cast<const int32_t*>(index.data());
  for (int step = 1; step <= 5; ++step) {
    feed(g, rng);
    plan_a.step({.eta = 1e-2f, .step = step});
    plan_b.step({.eta = 1e-2f, .step = step, .split = {LambPass::first, sums_at, index_at}});
    plan_b.step({.eta = 1e-2f, .step = step, .split = {LambPass::second, sums_at, index_at, 1, 2 * n}});
  }
  synchronize(device());
  for (size_t i = 0; i < kSizes.size(); ++i) {
    EXPECT_EQ(whole.w[i].bytes(), split.w[i].bytes()) << i;
    EXPECT_EQ(whole.rem[i].bytes(), split.rem[i].bytes()) << i;
    EXPECT_EQ(whole.m[i].bytes(), split.m[i].bytes()) << i;
    EXPECT_EQ(whole.v[i].bytes(), split.v[i].bytes()) << i;
  }
}

// Each combination that cannot work is refused at plan time, naming the
// argument; lamb_step then writes nothing.
TEST_P(RemainderLamb, RejectsCombinationsThatCannotWorkWithoutWriting) {
  const Device d = device();
  TestTensor w32(d, DType::f32, {1, 2}), w16(d, DType::bf16, {1, 2}), wh(d, DType::f16, {1, 2});
  TestTensor g(d, DType::f32, {1, 1}), m(d, DType::f32, {0.1, 0.1}), v(d, DType::f32, {0.1, 0.1});
  TestTensor r(d, DType::i16, {3, 4}), r32(d, DType::f32, {0, 0}), r3(d, DType::i16, {0, 0, 0});
  TestTensor copy(d, DType::bf16, {0, 0}), update16(d, DType::bf16, {0, 0}), update32(d, DType::f32, {0, 0});
  TestTensor qm(d, DType::u8, {0, 0}), qv(d, DType::u8, {0, 0}), am(d, DType::f32, {0}), av(d, DType::f32, {0});
  const TensorView W32[] = {w32.view()}, W16[] = {w16.view()}, WH[] = {wh.view()}, G[] = {g.view()},
                   M[] = {m.view()}, V[] = {v.view()}, R[] = {r.view()}, R32[] = {r32.view()}, R3[] = {r3.view()},
                   RR[] = {r.view(), r.view()}, C[] = {copy.view()}, U16[] = {update16.view()},
                   U32[] = {update32.view()}, QM[] = {qm.view()}, QV[] = {qv.view()}, AM[] = {am.view()},
                   AV[] = {av.view()};
  std::vector<const TestTensor*> all = {&w32, &w16, &wh, &m, &v, &r, &copy, &update16, &update32, &qm, &qv};
  std::vector<std::vector<uint8_t>> before;
  for (const TestTensor* t : all) before.push_back(t->bytes());
  const LambHyperparameters h;
  auto step = [&](LambTensors t) { lamb_step(t, h, {.eta = 1e-2f}); };
  expect_error([&] { step({W32, G, M, V, {}, {}, {}, {}, R}); }, ErrorCode::dtype_unsupported,
               {"weights", "bf16 (the weights weight_remainder completes"});
  expect_error([&] { step({WH, G, M, V, {}, {}, {}, {}, R}); }, ErrorCode::dtype_unsupported, {"weights", "bf16"});
  expect_error([&] { step({W16, G, M, V, {}, {}, {}, {}, {}}); }, ErrorCode::dtype_unsupported,
               {"weights", "bf16 with weight_remainder"});
  expect_error([&] { step({W16, G, M, V, C, {}, {}, {}, R}); }, ErrorCode::invalid_argument,
               {"model_copy", "weight_remainder", "expected none"});
  expect_error([&] { step({W16, G, M, V, {}, U16, {}, {}, R}); }, ErrorCode::invalid_argument,
               {"update", "weight_remainder", "expected none"});
  expect_error([&] { step({W16, G, M, V, {}, U32, {}, {}, R}); }, ErrorCode::invalid_argument,
               {"update", "weight_remainder"});
  expect_error([&] { step({W16, G, QM, QV, {}, {}, AM, AV, R}); }, ErrorCode::invalid_argument,
               {"weight_remainder", "4-bit moments (exp_avg u8)", "f32 or bf16 moments"});
  expect_error([&] { step({W16, G, M, V, {}, {}, {}, {}, R32}); }, ErrorCode::dtype_unsupported,
               {"weight_remainder", "i16"});
  expect_error([&] { step({W16, G, M, V, {}, {}, {}, {}, R3}); }, ErrorCode::size_mismatch, {"weight_remainder"});
  expect_error([&] { step({W16, G, M, V, {}, {}, {}, {}, RR}); }, ErrorCode::size_mismatch, {"weight_remainder"});
  synchronize(d);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i]->bytes(), before[i]) << "tensor " << i << " was written";
  // The same tensors, well formed, do step.
  step({W16, G, M, V, {}, {}, {}, {}, R});
  synchronize(d);
  EXPECT_NE(w16.bytes(), before[1]);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(RemainderLamb);

// CPU and CUDA take the f32-master path's arithmetic (docs/ops.md,
// "lamb_step"): with float moments the two backends' norms differ in their
// per-chunk sums (f64 on the CPU, f32 within a CUDA block), so their masters
// agree to rounding; on each backend the remainder master is the f32
// master bit for bit (RemainderLamb above, run on both).
TEST(RemainderLambBackends, CpuAndCudaMastersAgreeToRounding) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  constexpr int kSteps = 20;
  std::vector<std::vector<std::vector<double>>> masters;
  for (Device device : {Device::cpu(), Device::cuda(0)}) {
    std::mt19937_64 rng(61);
    const auto init = initial_masters(rng);
    State pair(device, init, true, DType::f32);
    std::vector<TestTensor> g;
    for (int64_t n : kSizes) g.emplace_back(device, DType::bf16, std::vector<double>(n, 0.5));
    const auto gv = views(g), pw = views(pair.w), pr = views(pair.rem), pm = views(pair.m), pv = views(pair.v);
    LambTensors t{pw, gv, pm, pv};
    t.weight_remainder = pr;
    const auto h = two_groups();
    const LambPlan plan(t, h, kGroups);
    for (int step = 1; step <= kSteps; ++step) {
      feed(g, rng);
      plan.step({.eta = 1e-2f, .step = step});
    }
    synchronize(device);
    masters.emplace_back();
    for (size_t i = 0; i < kSizes.size(); ++i) masters.back().push_back(pair.master_values(i));
  }
  for (size_t i = 0; i < kSizes.size(); ++i) {
    EXPECT_LE(relative_error(masters[1][i], masters[0][i]), optimizer_tolerance(DType::f32, kSteps)) << i;
  }
}

}  // namespace
}  // namespace gradkit::test
