// adam_step / AdamPlan on every backend against the float64 reference.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "support/adam_config.h"
#include "support/adam_reference.h"
#include "support/device_param.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

using Config = AdamConfig;

std::vector<Config> configs() {
  std::vector<Config> out;
  for (WeightDecay decay : {WeightDecay::l2, WeightDecay::decoupled, WeightDecay::hugging_face}) {
    for (bool bias : {true, false}) {
      Config c;
      c.name = std::string(decay == WeightDecay::l2 ? "l2" : decay == WeightDecay::decoupled ? "adamw" : "hf") +
               (bias ? "" : "_nobias");
      c.h.lr = 1e-2f;
      c.h.weight_decay = 0.05f;
      c.h.decay = decay;
      c.h.bias_correction = bias;
      out.push_back(c);
    }
  }
  Config ams;
  ams.name = "amsgrad_maximize";
  ams.h.amsgrad = true;
  ams.h.maximize = true;
  ams.h.weight_decay = 0.01f;
  out.push_back(ams);
  Config mixed;
  mixed.name = "bf16_grads_bf16_moments_bf16_copy";
  mixed.grad = DType::bf16;
  mixed.moment = DType::bf16;
  mixed.copy = DType::bf16;
  mixed.h.weight_decay = 0.01f;
  out.push_back(mixed);
  Config half_copy;
  half_copy.name = "f16_grads_f16_copy";
  half_copy.grad = DType::f16;
  half_copy.copy = DType::f16;
  out.push_back(half_copy);
  return out;
}

// Runs `steps` steps over a list of uneven tensors on `device`, checking the
// weights and moments against the reference after the last.
void run_against_reference(Device device, const Config& c, int steps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> sizes = {1, 7, 4096, 65536 + 3, 1000};
  std::vector<TestTensor> w, g, m, v, vmax, copy;
  std::vector<AdamReferenceState> ref;
  for (int64_t n : sizes) {
    AdamReferenceState s;
    s.w = round_to(DType::f32, random_values(rng, n));
    s.m.assign(n, 0.0);
    s.v.assign(n, 0.0);
    s.vmax.assign(n, 0.0);
    w.emplace_back(device, DType::f32, s.w);
    g.emplace_back(device, c.grad, std::vector<double>(n, 1.0));
    m.emplace_back(device, c.moment, s.m);
    v.emplace_back(device, c.moment, s.v);
    vmax.emplace_back(device, c.moment, s.vmax);
    copy.emplace_back(device, c.copy == DType::f32 ? DType::f16 : c.copy, std::vector<double>(n, 0.0));
    ref.push_back(s);
  }
  auto views = [](std::vector<TestTensor>& ts) {
    std::vector<TensorView> out;
    for (auto& t : ts) out.push_back(t.view());
    return out;
  };
  const auto wv = views(w), gv = views(g), mv = views(m), vv = views(v), xv = views(vmax), cv = views(copy);
  AdamTensors tensors{wv, gv, mv, vv, {}, {}};
  if (c.h.amsgrad) tensors.max_exp_avg_sq = xv;
  if (c.copy != DType::f32) tensors.model_copy = cv;
  const AdamPlan plan(tensors, std::span(&c.h, 1));

  for (int step = 1; step <= steps; ++step) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto grad = round_to(c.grad, random_values(rng, sizes[i]));
      g[i] = TestTensor(device, c.grad, grad);
      reference_adam_step(ref[i], grad, c.h, step, 1.0, DType::f32, c.moment);
    }
    // The grads were reallocated: plan them again, as a user would.
    std::vector<TensorView> gv2 = views(g);
    AdamTensors t2 = tensors;
    t2.grads = gv2;
    AdamPlan(t2, std::span(&c.h, 1)).step({.step = step});
  }
  synchronize(device);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string what = c.name + " tensor " + std::to_string(i) + " after " + std::to_string(steps) + " steps";
    EXPECT_LE(relative_error(w[i].read(), ref[i].w), optimizer_tolerance(DType::f32, steps) +
                                                         (c.moment == DType::bf16 ? optimizer_tolerance(DType::bf16, steps) : 0))
        << what << " (weights)";
    EXPECT_LE(relative_error(m[i].read(), ref[i].m), optimizer_tolerance(c.moment, steps)) << what << " (exp_avg)";
    EXPECT_LE(relative_error(v[i].read(), ref[i].v), optimizer_tolerance(c.moment, steps)) << what << " (exp_avg_sq)";
    if (c.h.amsgrad) {
      EXPECT_LE(relative_error(vmax[i].read(), ref[i].vmax), optimizer_tolerance(c.moment, steps)) << what << " (max)";
    }
    if (c.copy != DType::f32) {
      EXPECT_EQ(copy[i].read(), round_to(c.copy, w[i].read())) << what << ": the copy is the rounded weights";
    }
  }
}

using Adam = OnEachDevice;

TEST_P(Adam, EveryModeMatchesReferenceOver100Steps) {
  uint64_t seed = 100;
  for (const Config& c : configs()) run_against_reference(device(), c, 100, seed++);
}

TEST_P(Adam, F64MatchesReferenceClosely) {
  std::mt19937_64 rng(7);
  AdamHyperparameters h;
  h.lr = 0.05f;
  h.weight_decay = 0.1f;
  AdamReferenceState s{round_to(DType::f64, random_values(rng, 333)), std::vector<double>(333, 0.0),
                       std::vector<double>(333, 0.0), {}};
  TestTensor w(device(), DType::f64, s.w), m(device(), DType::f64, s.m), v(device(), DType::f64, s.v);
  for (int step = 1; step <= 20; ++step) {
    const auto grad = random_values(rng, 333);
    TestTensor g(device(), DType::f64, grad);
    const TensorView wv[] = {w.view()}, gv[] = {g.view()}, mv[] = {m.view()}, vv[] = {v.view()};
    adam_step({wv, gv, mv, vv, {}, {}}, h, {.step = step});
    reference_adam_step(s, grad, h, step, 1.0, DType::f64, DType::f64);
  }
  synchronize(device());
  EXPECT_LE(relative_error(w.read(), s.w), optimizer_tolerance(DType::f64, 20));
}

// State shared by the tests below: one plan over a few tensors with
// gradients that stay put, so steps can be replayed.
struct Fixture {
  std::vector<TestTensor> w, g, m, v;
  std::vector<TensorView> wv, gv, mv, vv;
  Fixture(Device device, uint64_t seed, DType grad = DType::f32) {
    std::mt19937_64 rng(seed);
    for (int64_t n : {5000, 17, 70000}) {
      w.emplace_back(device, DType::f32, random_values(rng, n));
      g.emplace_back(device, grad, random_values(rng, n));
      m.emplace_back(device, DType::f32, random_values(rng, n, 0.1));
      v.emplace_back(device, DType::f32, round_to(DType::f32, random_values(rng, n, 0.1)));
    }
    for (auto& t : v) {  // second moments are non-negative
      auto x = t.read();
      for (double& e : x) e = std::abs(e);
      t = TestTensor(device, DType::f32, x);
    }
    for (size_t i = 0; i < w.size(); ++i) {
      wv.push_back(w[i].view());
      gv.push_back(g[i].view());
      mv.push_back(m[i].view());
      vv.push_back(v[i].view());
    }
  }
  AdamTensors tensors() const { return {wv, gv, mv, vv, {}, {}}; }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &g, &m, &v}) {
      for (const auto& t : *list) out.push_back(t.bytes());
    }
    return out;
  }
};

TEST_P(Adam, FoundInfSkipsTheWholeStep) {
  Fixture f(device(), 31);
  const auto before = f.bits();
  TestFlag found_inf(device(), true);
  const AdamHyperparameters h;
  const AdamPlan plan(f.tensors(), std::span(&h, 1));
  plan.step({.step = 3, .found_inf = found_inf.pointer()});
  synchronize(device());
  EXPECT_EQ(f.bits(), before);
  TestFlag clean(device(), false);
  plan.step({.step = 3, .found_inf = clean.pointer()});
  synchronize(device());
  EXPECT_NE(f.bits(), before);
}

TEST_P(Adam, GradScaleDividesTheGradients) {
  Fixture scaled(device(), 41), plain(device(), 41);
  // Scale by a power of two so that scaled / scale is exact.
  for (size_t i = 0; i < scaled.g.size(); ++i) {
    auto g = scaled.g[i].read();
    for (double& x : g) x *= 1024.0;
    scaled.g[i] = TestTensor(device(), DType::f32, g);
    scaled.gv[i] = scaled.g[i].view();
  }
  const AdamHyperparameters h;
  AdamPlan(scaled.tensors(), std::span(&h, 1)).step({.step = 1, .grad_scale = 1024.0f});
  AdamPlan(plain.tensors(), std::span(&h, 1)).step({.step = 1});
  synchronize(device());
  for (size_t i = 0; i < plain.w.size(); ++i) EXPECT_EQ(scaled.w[i].bytes(), plain.w[i].bytes());
}

TEST_P(Adam, DeviceScalarsGiveTheSameResultAsHostValues) {
  Fixture on_device(device(), 51), on_host(device(), 51);
  const AdamHyperparameters h;
  const int64_t step = 7;
  const float lr = 3e-3f, scale = 2.0f;
  TestTensor step_t(device(), DType::f64, {0.0}), lr_t(device(), DType::f32, {lr}), scale_t(device(), DType::f32, {scale});
  const int64_t step_bits = step;
  copy_from_host(step_t.view().data, device(), &step_bits, sizeof step_bits);
  AdamHyperparameters host_h = h;
  host_h.lr = lr;
  AdamPlan(on_device.tensors(), std::span(&h, 1))
      .step({.step_device = step_t.view().as<int64_t>(), .lr_device = lr_t.view().as<float>(),
             .grad_scale_device = scale_t.view().as<float>()});
  AdamPlan(on_host.tensors(), std::span(&host_h, 1)).step({.step = step, .grad_scale = scale});
  synchronize(device());
  EXPECT_EQ(on_device.bits(), on_host.bits());
}

TEST_P(Adam, GroupsUseTheirOwnHyperparameters) {
  Fixture together(device(), 61), apart(device(), 61);
  AdamHyperparameters a, b;
  a.lr = 1e-2f;
  b.lr = 5e-4f;
  b.beta1 = 0.8f;
  b.decay = WeightDecay::l2;
  b.weight_decay = 0.1f;
  const AdamHyperparameters both[] = {a, b};
  const int32_t groups[] = {0, 1, 0};
  AdamPlan(together.tensors(), both, groups).step({.step = 2});
  for (size_t i = 0; i < 3; ++i) {
    const TensorView w[] = {apart.wv[i]}, g[] = {apart.gv[i]}, m[] = {apart.mv[i]}, v[] = {apart.vv[i]};
    adam_step({w, g, m, v, {}, {}}, groups[i] == 0 ? a : b, {.step = 2});
  }
  synchronize(device());
  EXPECT_EQ(together.bits(), apart.bits());
}

TEST_P(Adam, SetGradsGivesTheResultOfANewPlan) {
  // A plan re-pointed at other gradients updates exactly as a plan made on them.
  Fixture moved(device(), 81), fresh(device(), 81), other(device(), 82);
  const AdamHyperparameters h;
  AdamPlan plan(moved.tensors(), std::span(&h, 1));
  plan.set_grads(other.gv);  // new gradient memory, as a framework's next backward gives
  AdamTensors t = fresh.tensors();
  t.grads = other.gv;
  plan.step({.step = 1});
  AdamPlan(t, std::span(&h, 1)).step({.step = 1});
  synchronize(device());
  EXPECT_EQ(moved.bits(), fresh.bits());
}

TEST_P(Adam, SetGradsRejectsAMismatchWithoutChangingThePlan) {
  Fixture f(device(), 91), g(device(), 92);
  const AdamHyperparameters h;
  AdamPlan plan(f.tensors(), std::span(&h, 1));
  const void* before = plan.plan().pointers()[f.gv.size()];
  std::vector<TensorView> short_list(g.gv.begin(), g.gv.end() - 1);
  EXPECT_THROW(plan.set_grads(short_list), Error);
  std::vector<TensorView> resized = g.gv;
  resized[0].numel -= 1;
  try {
    plan.set_grads(resized);
    FAIL() << "a gradient of the wrong size was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::size_mismatch);
    EXPECT_NE(std::string(e.what()).find("grads[0]"), std::string::npos) << e.what();
  }
  std::vector<TensorView> aliased = g.gv;
  aliased[1] = {f.wv[2].data, aliased[1].numel, DType::f32, device()};  // inside a weight the step writes
  EXPECT_THROW(plan.set_grads(aliased), Error);
  EXPECT_EQ(plan.plan().pointers()[f.gv.size()], before);
}

TEST_P(Adam, BitwiseDeterministic) {
  Fixture first(device(), 71, DType::bf16), second(device(), 71, DType::bf16);
  AdamHyperparameters h;
  h.weight_decay = 0.02f;
  const AdamPlan p1(first.tensors(), std::span(&h, 1)), p2(second.tensors(), std::span(&h, 1));
  for (int step = 1; step <= 5; ++step) {
    p1.step({.step = step});
    p2.step({.step = step});
  }
  synchronize(device());
  EXPECT_EQ(first.bits(), second.bits());
}

TEST_P(Adam, RejectsBadInputsWithoutWriting) {
  Fixture f(device(), 81);
  const auto before = f.bits();
  auto expect_error = [&](auto&& call, ErrorCode code, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    synchronize(device());
    EXPECT_EQ(f.bits(), before) << fragment;
  };
  AdamHyperparameters h;
  for (auto [field, bad] : std::vector<std::pair<std::string, AdamHyperparameters>>{
           {"beta1", [] { AdamHyperparameters x; x.beta1 = 1.0f; return x; }()},
           {"beta2", [] { AdamHyperparameters x; x.beta2 = -0.1f; return x; }()},
           {"eps", [] { AdamHyperparameters x; x.eps = 0.0f; return x; }()},
           {"lr", [] { AdamHyperparameters x; x.lr = NAN; return x; }()},
           {"weight_decay", [] { AdamHyperparameters x; x.weight_decay = -1.0f; return x; }()}}) {
    expect_error([&] { AdamPlan(f.tensors(), std::span(&bad, 1)); }, ErrorCode::invalid_argument,
                 "'hyperparameters[0]." + field + "'");
  }
  const AdamPlan plan(f.tensors(), std::span(&h, 1));
  expect_error([&] { plan.step({.step = 0}); }, ErrorCode::invalid_argument, "'step'");
  expect_error([&] { plan.step({.step = 1, .grad_scale = 0.0f}); }, ErrorCode::invalid_argument, "'grad_scale'");
  expect_error([&] { plan.step({.step = 1, .grad_scale = INFINITY}); }, ErrorCode::invalid_argument, "'grad_scale'");
  TestTensor steps(device(), DType::f64, {1.0, 2.0});
  auto* misaligned = reinterpret_cast<int64_t*>(static_cast<char*>(steps.view().data) + 4);
  expect_error([&] { plan.step({.step_device = misaligned}); }, ErrorCode::invalid_argument, "'step_device'");

  AdamTensors short_grads = f.tensors();
  short_grads.grads = std::span(f.gv).first(2);
  expect_error([&] { AdamPlan(short_grads, std::span(&h, 1)); }, ErrorCode::size_mismatch, "'grads'");

  AdamHyperparameters ams;
  ams.amsgrad = true;
  expect_error([&] { AdamPlan(f.tensors(), std::span(&ams, 1)); }, ErrorCode::size_mismatch, "'max_exp_avg_sq'");

  std::vector<TensorView> f16_weights = f.wv;
  for (auto& t : f16_weights) t.dtype = DType::f16, t.numel = t.numel;
  AdamTensors wrong = f.tensors();
  wrong.weights = f16_weights;
  expect_error([&] { AdamPlan(wrong, std::span(&h, 1)); }, ErrorCode::dtype_unsupported, "'weights'");

  AdamTensors aliased = f.tensors();
  aliased.exp_avg_sq = f.mv;
  expect_error([&] { AdamPlan(aliased, std::span(&h, 1)); }, ErrorCode::aliasing, "overlaps");

  const int32_t bad_groups[] = {0, 1, 0};
  expect_error([&] { AdamPlan(f.tensors(), std::span(&h, 1), bad_groups); }, ErrorCode::invalid_argument,
               "'groups[1]'");
}

TEST_P(Adam, NonFiniteGradientsPropagateWithoutFoundInf) {
  TestTensor w(device(), DType::f32, {1.0, 2.0}), g(device(), DType::f32, {NAN, 1.0});
  TestTensor m(device(), DType::f32, {0.0, 0.0}), v(device(), DType::f32, {0.0, 0.0});
  const TensorView wv[] = {w.view()}, gv[] = {g.view()}, mv[] = {m.view()}, vv[] = {v.view()};
  adam_step({wv, gv, mv, vv, {}, {}}, AdamHyperparameters{}, {.step = 1});
  synchronize(device());
  const auto got = w.read();
  EXPECT_TRUE(std::isnan(got[0]));
  EXPECT_TRUE(std::isfinite(got[1]));
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Adam);

}  // namespace
}  // namespace gradkit::test
