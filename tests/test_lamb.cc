// lamb_step / LambPlan on every backend against the float64 reference.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/lamb.h"
#include "support/device_param.h"
#include "support/lamb_reference.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

// Tensors of one run: weights, gradients, moments (and copies / updates).
struct Lists {
  std::vector<TestTensor> w, g, m, v, copy, update;
  std::vector<TensorView> wv, gv, mv, vv, cv, uv;
  std::vector<LambReferenceState> ref;
  DType grad_dtype, moment_dtype;

  Lists(Device device, std::mt19937_64& rng, const std::vector<int64_t>& sizes, DType grad = DType::f32,
        DType moment = DType::f32, DType copy_dtype = DType::f32, bool with_update = false)
      : grad_dtype(grad), moment_dtype(moment) {
    for (int64_t n : sizes) {
      LambReferenceState s;
      s.w = round_to(DType::f32, random_values(rng, n));
      s.m = round_to(moment, random_values(rng, n, 0.01));
      s.v = random_values(rng, n, 0.01);
      for (double& x : s.v) x = std::abs(x);
      s.v = round_to(moment, s.v);
      w.emplace_back(device, DType::f32, s.w);
      g.emplace_back(device, grad, random_values(rng, n));
      m.emplace_back(device, moment, s.m);
      v.emplace_back(device, moment, s.v);
      if (copy_dtype != DType::f32) copy.emplace_back(device, copy_dtype, random_values(rng, n));
      if (with_update) update.emplace_back(device, DType::f32, random_values(rng, n));
      ref.push_back(s);
    }
    refresh_views();
  }
  void refresh_views() {
    auto views = [](std::vector<TestTensor>& ts, std::vector<TensorView>& out) {
      out.clear();
      for (auto& t : ts) out.push_back(t.view());
    };
    views(w, wv), views(g, gv), views(m, mv), views(v, vv), views(copy, cv), views(update, uv);
  }
  LambTensors tensors() const { return {wv, gv, mv, vv, cv, uv}; }
  // New seeded gradients (written into the same memory, so plans stay valid).
  std::vector<std::vector<double>> new_gradients(std::mt19937_64& rng) {
    std::vector<std::vector<double>> out;
    for (auto& t : g) {
      out.push_back(round_to(grad_dtype, random_values(rng, t.numel())));
      const TestTensor fresh(t.view().device, grad_dtype, out.back());
      const auto bytes = fresh.bytes();
      copy_from_host(t.view().data, t.view().device, bytes.data(), bytes.size());
    }
    return out;
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &g, &m, &v, &copy, &update}) {
      for (const auto& t : *list) out.push_back(t.bytes());
    }
    return out;
  }
};

const std::vector<int64_t> kSizes = {1, 300, 65536 + 9, 4096, 2};

void expect_matches(const Lists& l, int steps, const std::string& what) {
  const double tol = optimizer_tolerance(DType::f32, steps) +
                     (l.moment_dtype == DType::bf16 ? optimizer_tolerance(DType::bf16, steps) : 0);
  for (size_t i = 0; i < l.w.size(); ++i) {
    EXPECT_LE(relative_error(l.w[i].read(), l.ref[i].w), tol) << what << " tensor " << i << " weights";
    EXPECT_LE(relative_error(l.m[i].read(), l.ref[i].m), optimizer_tolerance(l.moment_dtype, steps) * 4)
        << what << " tensor " << i << " exp_avg";
    EXPECT_LE(relative_error(l.v[i].read(), l.ref[i].v), optimizer_tolerance(l.moment_dtype, steps) * 4)
        << what << " tensor " << i << " exp_avg_sq";
  }
}

struct Config {
  std::string name;
  LambHyperparameters h;
  LambReferenceInputs in;
  DType grad = DType::f32, moment = DType::f32, copy = DType::f32;
};

std::vector<Config> configs() {
  std::vector<Config> out;
  Config base;
  base.name = "default";
  base.h.lambda = 0.01f;
  out.push_back(base);
  Config nobias = base;
  nobias.name = "no_bias_correction";
  nobias.h.bias_correction = false;
  out.push_back(nobias);
  Config clamp = base;
  clamp.name = "ratio_clamped";
  clamp.h.ratio_min = 0.05f;
  clamp.h.ratio_max = 0.2f;
  out.push_back(clamp);
  Config clip = base;
  clip.name = "loss_scale_and_clipping";
  clip.in.loss_scale = 512;
  clip.in.gradient_norm = 512 * 40.0;  // unscaled norm 40 > max_norm 1: clipped
  out.push_back(clip);
  Config mixed = base;
  mixed.name = "bf16_grads_bf16_moments_f16_copy";
  mixed.grad = DType::bf16;
  mixed.moment = DType::bf16;
  mixed.copy = DType::f16;
  out.push_back(mixed);
  return out;
}

using Lamb = OnEachDevice;

TEST_P(Lamb, MatchesReferenceOver20Steps) {
  uint64_t seed = 300;
  for (const Config& c : configs()) {
    std::mt19937_64 rng(seed++);
    Lists l(device(), rng, kSizes, c.grad, c.moment, c.copy);
    const LambPlan plan(l.tensors(), std::span(&c.h, 1));
    for (int step = 1; step <= 20; ++step) {
      const auto grads = l.new_gradients(rng);
      LambStepInputs in;
      in.eta = static_cast<float>(c.in.eta);
      in.loss_scale = static_cast<float>(c.in.loss_scale);
      in.gradient_norm = static_cast<float>(c.in.gradient_norm);
      in.step = step;
      plan.step(in);
      LambReferenceInputs rin = c.in;
      rin.step = step;
      for (size_t i = 0; i < kSizes.size(); ++i) reference_lamb_step(l.ref[i], grads[i], c.h, rin, DType::f32, c.moment);
    }
    synchronize(device());
    expect_matches(l, 20, c.name);
    if (c.copy != DType::f32) {
      for (size_t i = 0; i < kSizes.size(); ++i) EXPECT_EQ(l.copy[i].read(), round_to(c.copy, l.w[i].read())) << c.name;
    }
  }
}

TEST_P(Lamb, ZeroNormTensorUsesRatioOne) {
  std::mt19937_64 rng(1);
  Lists l(device(), rng, {1000, 500});
  l.w[0] = TestTensor(device(), DType::f32, std::vector<double>(1000, 0.0));  // |w| = 0
  l.ref[0].w.assign(1000, 0.0);
  l.refresh_views();
  LambHyperparameters h;
  h.ratio_min = 0.5f;  // would be used if the ratio were clamped rather than set to 1
  h.ratio_max = 0.5f;
  const auto grads = l.new_gradients(rng);
  LambStepInputs in;
  in.eta = 0.01f;
  LambPlan(l.tensors(), std::span(&h, 1)).step(in);
  LambReferenceInputs rin;
  rin.eta = 0.01;
  for (int i = 0; i < 2; ++i) reference_lamb_step(l.ref[i], grads[i], h, rin, DType::f32, DType::f32);
  synchronize(device());
  expect_matches(l, 1, "zero-norm");
}

TEST_P(Lamb, NonFiniteGradientElementKeepsItsStateAndWeight) {
  std::mt19937_64 rng(2);
  Lists l(device(), rng, {4099, 64});
  auto grads = l.new_gradients(rng);
  grads[0][17] = INFINITY;
  grads[0][4098] = NAN;
  l.g[0] = TestTensor(device(), DType::f32, grads[0]);
  l.refresh_views();
  const auto w0 = l.w[0].read(), m0 = l.m[0].read(), v0 = l.v[0].read();
  LambHyperparameters h;
  h.lambda = 0.01f;
  LambStepInputs in;
  in.eta = 0.01f;
  LambPlan(l.tensors(), std::span(&h, 1)).step(in);
  LambReferenceInputs rin;
  rin.eta = 0.01;
  for (int i = 0; i < 2; ++i) reference_lamb_step(l.ref[i], grads[i], h, rin, DType::f32, DType::f32);
  synchronize(device());
  const auto w1 = l.w[0].read(), m1 = l.m[0].read(), v1 = l.v[0].read();
  for (size_t e : {size_t{17}, size_t{4098}}) {
    EXPECT_EQ(w1[e], w0[e]) << e;
    EXPECT_EQ(m1[e], m0[e]) << e;
    EXPECT_EQ(v1[e], v0[e]) << e << ": the mark on v must be cleared";
    EXPECT_FALSE(std::signbit(v1[e]));
  }
  EXPECT_NE(w1[18], w0[18]);
  expect_matches(l, 1, "non-finite element");
}

TEST_P(Lamb, DoUpdateFalseOrFoundInfWritesNothingAndKeepsTheStep) {
  std::mt19937_64 rng(3);
  Lists l(device(), rng, kSizes);
  const LambHyperparameters h;
  const LambPlan plan(l.tensors(), std::span(&h, 1));
  const auto before = l.bits();
  TestTensor step(device(), DType::f64, {0.0});
  const int64_t five = 5;
  copy_from_host(step.view().data, device(), &five, sizeof five);
  TestFlag off(device(), false), inf(device(), true), clean(device(), false), on(device(), true);
  for (const LambStepInputs& in :
       {LambStepInputs{.step_device = step.view().as<int64_t>(), .do_update = Flag::host(false)},
        LambStepInputs{.step_device = step.view().as<int64_t>(), .do_update = Flag::device(off.pointer())},
        LambStepInputs{.step_device = step.view().as<int64_t>(), .found_inf = inf.pointer()}}) {
    plan.step(in);
    synchronize(device());
    EXPECT_EQ(l.bits(), before);
    int64_t now = 0;
    copy_to_host(&now, step.view().data, sizeof now, device());
    EXPECT_EQ(now, 5);
  }
  plan.step({.step_device = step.view().as<int64_t>(), .do_update = Flag::device(on.pointer()),
             .found_inf = clean.pointer()});
  synchronize(device());
  EXPECT_NE(l.bits(), before);
  int64_t now = 0;
  copy_to_host(&now, step.view().data, sizeof now, device());
  EXPECT_EQ(now, 6);
}

TEST_P(Lamb, FiveThousandGroupsEachWithItsOwnHyperparameters) {
  std::mt19937_64 rng(4);
  std::vector<int64_t> sizes(5000);
  for (int64_t& n : sizes) n = 1 + static_cast<int64_t>(rng() % 200);
  Lists l(device(), rng, sizes);
  std::vector<LambHyperparameters> hyper(5000);
  std::vector<int32_t> groups(5000);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int i = 0; i < 5000; ++i) {
    hyper[i].alpha = 0.8f + 0.19f * u(rng);
    hyper[i].lambda = 0.05f * u(rng);
    hyper[i].ratio_max = 0.5f + u(rng);
    groups[i] = i;
  }
  const auto grads = l.new_gradients(rng);
  LambStepInputs in;
  in.eta = 0.01f;
  LambPlan(l.tensors(), hyper, groups).step(in);
  LambReferenceInputs rin;
  rin.eta = 0.01;
  for (int i = 0; i < 5000; ++i) reference_lamb_step(l.ref[i], grads[i], hyper[i], rin, DType::f32, DType::f32);
  synchronize(device());
  expect_matches(l, 1, "5000 groups");
}

TEST_P(Lamb, UpdateOutputLeavesTheWeights) {
  std::mt19937_64 rng(5);
  Lists l(device(), rng, kSizes, DType::f32, DType::f32, DType::f32, /*with_update=*/true);
  const auto w_before = l.w[2].bytes();
  const auto grads = l.new_gradients(rng);
  LambHyperparameters h;
  h.lambda = 0.01f;
  LambStepInputs in;
  in.eta = 0.05f;
  LambPlan(l.tensors(), std::span(&h, 1)).step(in);
  LambReferenceInputs rin;
  rin.eta = 0.05;
  for (size_t i = 0; i < kSizes.size(); ++i) reference_lamb_step(l.ref[i], grads[i], h, rin, DType::f32, DType::f32);
  synchronize(device());
  EXPECT_EQ(l.w[2].bytes(), w_before);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    EXPECT_LE(relative_error(l.update[i].read(), l.ref[i].last_update), 1e-5) << i;
  }
}

TEST_P(Lamb, BitwiseDeterministic) {
  std::mt19937_64 a(6), b(6);
  Lists first(device(), a, kSizes, DType::bf16), second(device(), b, kSizes, DType::bf16);
  LambHyperparameters h;
  h.lambda = 0.01f;
  const LambPlan p1(first.tensors(), std::span(&h, 1)), p2(second.tensors(), std::span(&h, 1));
  for (int step = 1; step <= 4; ++step) {
    first.new_gradients(a);
    second.new_gradients(b);
    p1.step({.eta = 0.01f, .step = step});
    p2.step({.eta = 0.01f, .step = step});
  }
  synchronize(device());
  EXPECT_EQ(first.bits(), second.bits());
}

// Every tensor cut in two pieces held by two plans (as two ranks' shards
// hold them): pass 1 on each writes its row of sums, pass 2 on each adds
// both rows in order. The moments are bitwise those of the whole step; the
// trust ratio sums in another order, so the weights agree to f32 roundoff.
TEST_P(Lamb, TwoPassesOverPiecesMatchTheWholeStep) {
  std::mt19937_64 a(9), b(9), ga(10), gb(10);
  Lists whole(device(), a, kSizes), cut(device(), b, kSizes);
  LambHyperparameters h;
  h.lambda = 0.01f;
  const LambPlan full(whole.tensors(), std::span(&h, 1));
  const size_t n = kSizes.size();
  std::vector<LambTensors> halves(2);
  std::vector<std::vector<TensorView>> lists(8);  // w, g, m, v for each half
  for (size_t i = 0; i < n; ++i) {
    const int64_t mid = kSizes[i] / 2;
    for (int half = 0; half < 2; ++half) {
      const int64_t at = half == 0 ? 0 : mid, count = half == 0 ? mid : kSizes[i] - mid;
      const TensorView* sources[] = {&cut.wv[i], &cut.gv[i], &cut.mv[i], &cut.vv[i]};
      for (int k = 0; k < 4; ++k) {
        const TensorView& t = *sources[k];
        lists[half * 4 + k].push_back(
            {static_cast<unsigned char*>(t.data) + at * static_cast<int64_t>(dtype_size(t.dtype)), count, t.dtype, t.device});
      }
    }
  }
  for (int half = 0; half < 2; ++half) {
    halves[half] = {lists[half * 4], lists[half * 4 + 1], lists[half * 4 + 2], lists[half * 4 + 3], {}, {}};
  }
  const LambPlan first_half(halves[0], std::span(&h, 1)), second_half(halves[1], std::span(&h, 1));
  std::vector<int32_t> index(n);
  for (size_t i = 0; i < n; ++i) index[i] = static_cast<int32_t>(i);
  Buffer index_buffer(device(), n * sizeof(int32_t)), sums(device(), 2 * 2 * n * sizeof(double));
  copy_from_host(index_buffer.data(), device(), index.data(), n * sizeof(int32_t));
  const auto* idx = static_cast<const int32_t*>(index_buffer.data());
  auto* rows = static_cast<double*>(sums.data());
  const auto stride = static_cast<int64_t>(2 * n);
  for (int step = 1; step <= 3; ++step) {
    whole.new_gradients(ga);
    cut.new_gradients(gb);
    full.step({.eta = 0.01f, .step = step});
    first_half.step({.eta = 0.01f, .step = step, .split = {LambPass::first, rows, idx}});
    second_half.step({.eta = 0.01f, .step = step, .split = {LambPass::first, rows + stride, idx}});
    for (const LambPlan* p : {&first_half, &second_half}) {
      p->step({.eta = 0.01f, .step = step, .split = {LambPass::second, rows, idx, 2, stride}});
    }
  }
  synchronize(device());
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(cut.m[i].bytes(), whole.m[i].bytes()) << "tensor " << i;
    EXPECT_EQ(cut.v[i].bytes(), whole.v[i].bytes()) << "tensor " << i;
    EXPECT_LE(relative_error(cut.w[i].read(), whole.w[i].read()), 4 * elementwise_tolerance(DType::f32).relative)
        << "tensor " << i;
  }
  // The split's own arguments are checked before anything is written.
  const auto before = cut.bits();
  try {
    first_half.step({.eta = 0.01f, .step = 4, .split = {LambPass::second, nullptr, idx}});
    ADD_FAILURE() << "a null split.sums was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'split.sums'"), std::string::npos) << e.what();
  }
  try {
    first_half.step({.eta = 0.01f, .step = 4, .split = {LambPass::second, rows, idx, 0, stride}});
    ADD_FAILURE() << "split.rows 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'split.rows'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cut.bits(), before);
}

TEST_P(Lamb, RejectsBadInputsWithoutWriting) {
  std::mt19937_64 rng(7);
  Lists l(device(), rng, kSizes, DType::f32, DType::f32, DType::f16, true);
  const auto before = l.bits();
  auto expect_error = [&](auto&& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    synchronize(device());
    EXPECT_EQ(l.bits(), before) << fragment;
  };
  LambTensors plain = l.tensors();
  plain.model_copy = {};
  plain.update = {};
  for (auto [field, bad] : std::vector<std::pair<std::string, LambHyperparameters>>{
           {"alpha", [] { LambHyperparameters x; x.alpha = 1.0f; return x; }()},
           {"beta", [] { LambHyperparameters x; x.beta = 2.0f; return x; }()},
           {"epsilon", [] { LambHyperparameters x; x.epsilon = 0.0f; return x; }()},
           {"lambda", [] { LambHyperparameters x; x.lambda = -0.1f; return x; }()},
           {"ratio_max", [] { LambHyperparameters x; x.ratio_min = 2.0f; x.ratio_max = 1.0f; return x; }()}}) {
    expect_error([&] { LambPlan(plain, std::span(&bad, 1)); }, "'hyperparameters[0]." + field + "'");
  }
  const LambHyperparameters h;
  expect_error([&] { LambPlan(l.tensors(), std::span(&h, 1)); }, "'model_copy'");
  const LambPlan plan(plain, std::span(&h, 1));
  expect_error([&] { plan.step({.eta = NAN}); }, "'eta'");
  expect_error([&] { plan.step({.loss_scale = 0.0f}); }, "'loss_scale'");
  expect_error([&] { plan.step({.step = 0}); }, "'step'");
  LambTensors short_m = plain;
  short_m.exp_avg = std::span(l.mv).first(3);
  expect_error([&] { LambPlan(short_m, std::span(&h, 1)); }, "'exp_avg'");
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Lamb);

}  // namespace
}  // namespace gradkit::test
