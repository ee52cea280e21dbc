// The gradient check, the loss scaler and the mixed-precision optimizer on
// every backend, against float64 references and PyTorch GradScaler's rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/grad_check.h"
#include "gradkit/optim/mixed_precision.h"
#include "support/adam_reference.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/state_file_bytes.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

// ---- references -----------------------------------------------------------

// PyTorch GradScaler's update (with DeepSpeed's hysteresis and the bounds).
struct ReferenceScaler {
  LossScalerOptions o;
  double scale;
  int growth = 0, hysteresis_left;
  explicit ReferenceScaler(LossScalerOptions options)
      : o(options), scale(options.initial_scale), hysteresis_left(options.hysteresis) {}
  void update(bool found_inf) {
    if (o.mode != LossScaling::dynamic) return;
    if (found_inf) {
      growth = 0;
      if (hysteresis_left <= 1) scale = std::max(scale * o.backoff_factor, static_cast<double>(o.min_scale));
      else --hysteresis_left;
      return;
    }
    if (++growth == o.growth_interval) {
      const double grown = scale * o.growth_factor;
      if (std::isfinite(static_cast<float>(grown))) scale = std::min(grown, static_cast<double>(o.max_scale));
      growth = 0;
      hysteresis_left = o.hysteresis;
    }
  }
};

double reference_norm(const std::vector<std::vector<double>>& grads, double scale, NormType type) {
  double acc = 0;
  for (const auto& g : grads) {
    for (double x : g) acc = type == NormType::l2 ? acc + (x / scale) * (x / scale) : std::max(acc, std::abs(x / scale));
  }
  return type == NormType::l2 ? std::sqrt(acc) : acc;
}

// ---- the gradient check ---------------------------------------------------

using GradientCheck = OnEachDevice;

TEST_P(GradientCheck, NormsFlagAndDivisorMatchTheReference) {
  std::mt19937_64 rng(1);
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (NormType type : {NormType::l2, NormType::infinity}) {
      std::vector<TestTensor> grads;
      std::vector<std::vector<double>> values;
      std::vector<TensorView> views;
      for (int64_t n : {1, 1000, 65536 * 3 + 1, 0, 77}) {
        values.push_back(round_to(dtype, random_values(rng, n, 1024.0)));
        grads.emplace_back(device(), dtype, values.back());
      }
      for (auto& t : grads) views.push_back(t.view());
      const float scale = 1024.0f, max_norm = 0.5f;
      TestTensor out(device(), DType::f32, std::vector<double>(3 + grads.size(), -1.0));
      TestFlag found(device(), true);
      float* o = out.view().as<float>();
      GradientCheckPlan(views, {type, max_norm}).check({found.pointer(), o, o + 1, o + 2}, scale);
      synchronize(device());
      const auto got = out.read();
      const double norm = reference_norm(values, scale, type);
      const std::string what = std::string(dtype_name(dtype)) + (type == NormType::l2 ? " l2" : " inf");
      EXPECT_FALSE(found.read()) << what;
      EXPECT_NEAR(got[1], norm, 1e-6 * norm) << what;
      const double coefficient = max_norm / (norm + 1e-6);
      EXPECT_NEAR(got[0], scale / std::min(coefficient, 1.0), 1e-6 * got[0]) << what;
      for (size_t t = 0; t < values.size(); ++t) {
        const double tn = reference_norm({values[t]}, scale, type);
        EXPECT_NEAR(got[2 + t], tn, 1e-6 * tn + 1e-30) << what << " tensor " << t;
      }
    }
  }
}

// Three lists checked apart (the ranks' shards), their partials combined:
// the flag, norm and divisor of one check over all three, with a NaN in
// one list caught, and the combine's own arguments checked.
TEST_P(GradientCheck, CombinedPartialsOfSeveralListsMatchOneCheck) {
  std::mt19937_64 rng(5);
  for (NormType type : {NormType::l2, NormType::infinity}) {
    for (bool poison : {false, true}) {
      std::vector<std::vector<double>> values;
      std::vector<TestTensor> grads;
      for (int64_t n : {1000, 70000, 3}) {
        values.push_back(round_to(DType::f16, random_values(rng, n, 64.0)));
        grads.emplace_back(device(), DType::f16, values.back());
      }
      if (poison) {
        std::vector<double> v = values[1];
        v[500] = NAN;
        grads[1] = TestTensor(device(), DType::f16, v);
      }
      const float scale = 64.0f, max_norm = 2.0f;
      TestTensor partials(device(), DType::f64, std::vector<double>(6, -1.0));
      std::vector<GradientCheckPlan> plans;
      for (size_t i = 0; i < grads.size(); ++i) {
        const TensorView view = grads[i].view();
        plans.emplace_back(std::span<const TensorView>(&view, 1), GradientCheckOptions{type, max_norm});
        plans.back().check({.partial = partials.view().as<double>() + 2 * i}, scale);
      }
      TestTensor out(device(), DType::f32, std::vector<double>(2, -1.0));
      TestFlag found(device(), !poison);
      float* o = out.view().as<float>();
      plans[0].combine(partials.view().as<double>(), 3, {.found_inf = found.pointer(), .grad_divisor = o, .global_norm = o + 1},
                       scale);
      synchronize(device());
      const auto got = out.read();
      const std::string what = std::string(type == NormType::l2 ? "l2" : "inf") + (poison ? " with a NaN" : "");
      EXPECT_EQ(found.read(), poison) << what;
      if (poison) {
        EXPECT_TRUE(std::isnan(got[1])) << what;
        EXPECT_EQ(got[0], scale) << what;  // a skipped step's divisor is the scale
        continue;
      }
      const double norm = reference_norm(values, scale, type);
      EXPECT_NEAR(got[1], norm, 1e-6 * norm) << what;
      EXPECT_NEAR(got[0], scale / std::min(max_norm / (norm + 1e-6), 1.0), 1e-6 * got[0]) << what;
    }
  }
  const TestTensor g(device(), DType::f32, {1.0, 2.0});
  const TensorView view = g.view();
  const GradientCheckPlan plan(std::span<const TensorView>(&view, 1));
  TestTensor partials(device(), DType::f64, {1.0, 0.0});
  TestTensor out(device(), DType::f32, {-1.0, -1.0});
  float* o = out.view().as<float>();
  expect_error([&] { plan.combine(partials.view().as<double>(), 0, {.global_norm = o}); }, ErrorCode::invalid_argument,
               {"'count'", ">= 1"});
  expect_error([&] { plan.combine(nullptr, 1, {.global_norm = o}); }, ErrorCode::null_pointer, {"'partials'"});
  expect_error([&] { plan.combine(partials.view().as<double>(), 1, {.tensor_norms = o}); },
               ErrorCode::invalid_argument, {"'tensor_norms'", "null"});
  EXPECT_EQ(out.read(), (std::vector<double>{-1.0, -1.0}));  // nothing written
}

TEST_P(GradientCheck, OneBadElementAmongTenThousandTensorsIsCaught) {
  std::mt19937_64 rng(2);
  std::vector<TestTensor> grads;
  std::vector<TensorView> views;
  for (int i = 0; i < 10000; ++i) grads.emplace_back(device(), DType::f16, random_values(rng, 1 + rng() % 100));
  auto poison = [&](int tensor, int64_t element, double value) {
    auto v = grads[tensor].read();
    v[element % v.size()] = value;
    grads[tensor] = TestTensor(device(), DType::f16, v);
  };
  poison(7777, 3, INFINITY);
  for (auto& t : grads) views.push_back(t.view());
  const GradientCheckPlan plan(views);
  TestFlag found(device(), false);
  plan.check({found.pointer(), nullptr, nullptr, nullptr});
  synchronize(device());
  EXPECT_TRUE(found.read());
  // An f16 value that is finite but whose square overflows f16 is no overflow.
  poison(7777, 3, 60000.0);
  views[7777] = grads[7777].view();
  GradientCheckPlan(views).check({found.pointer(), nullptr, nullptr, nullptr});
  synchronize(device());
  EXPECT_FALSE(found.read());
  poison(9999, 0, NAN);
  views[9999] = grads[9999].view();
  GradientCheckPlan(views).check({found.pointer(), nullptr, nullptr, nullptr});
  synchronize(device());
  EXPECT_TRUE(found.read());
}

// A NaN is caught by the infinity norm too, and makes its own tensor's norm
// NaN while the others stay finite.
TEST_P(GradientCheck, ANonFiniteTensorHasANaNNorm) {
  for (NormType type : {NormType::l2, NormType::infinity}) {
    TestTensor a(device(), DType::f32, {1.0, NAN, 2.0}), b(device(), DType::f32, {3.0, -4.0});
    const TensorView views[] = {a.view(), b.view()};
    TestTensor out(device(), DType::f32, {0.0, 0.0, 0.0});
    TestFlag found(device(), false);
    float* o = out.view().as<float>();
    GradientCheckPlan(views, {type}).check({found.pointer(), nullptr, o, o + 1});
    synchronize(device());
    const auto got = out.read();
    EXPECT_TRUE(found.read());
    EXPECT_TRUE(std::isnan(got[0]));
    EXPECT_TRUE(std::isnan(got[1]));
    EXPECT_EQ(got[2], type == NormType::l2 ? 5.0 : 4.0);
  }
}

TEST(DefaultConstructed, ObjectsAreEmptyOrSayWhatIsMissing) {
  EXPECT_NO_THROW(AdamPlan{}.step({}));
  EXPECT_NO_THROW(LambPlan{}.step({}));
  EXPECT_NO_THROW(GradientCheckPlan{}.check({}));
  bool flag = false;
  try {
    LossScaler{}.update(&flag);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("default-constructed"), std::string::npos) << e.what();
  }
}

TEST_P(GradientCheck, WriteUnscaledMultipliesByTheInverseScale) {
  std::mt19937_64 rng(3);
  const auto values = round_to(DType::bf16, random_values(rng, 5000, 64.0));
  TestTensor g(device(), DType::bf16, values);
  const TensorView views[] = {g.view()};
  GradientCheckPlan(views, {NormType::l2, 0.0f, /*write_unscaled=*/true}).check({}, 64.0f);
  synchronize(device());
  std::vector<double> want(values.size());
  for (size_t i = 0; i < values.size(); ++i) want[i] = values[i] / 64.0;
  EXPECT_EQ(g.read(), round_to(DType::bf16, want));
}

TEST_P(GradientCheck, RejectsBadInputs) {
  TestTensor g(device(), DType::f64, {1.0, 2.0});
  const TensorView views[] = {g.view()};
  EXPECT_THROW(GradientCheckPlan{views}, Error);
  TestTensor h(device(), DType::f32, {1.0, 2.0});
  const TensorView ok[] = {h.view()};
  EXPECT_THROW(GradientCheckPlan(ok, {NormType::l2, -1.0f}), Error);
  try {
    GradientCheckPlan(ok).check({}, 0.0f);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'loss_scale'"), std::string::npos) << e.what();
  }
}

// ---- the loss scaler ------------------------------------------------------

using Scaler = OnEachDevice;

TEST_P(Scaler, MakesGradScalersDecisions) {
  for (int32_t hysteresis : {1, 3}) {
    LossScalerOptions o;
    o.growth_interval = 3;
    o.hysteresis = hysteresis;
    o.min_scale = 4.0f;
    o.max_scale = 1 << 18;
    o.initial_scale = 1 << 16;
    LossScaler scaler(device(), o);
    ReferenceScaler ref(o);
    TestFlag flag(device(), false);
    std::mt19937_64 rng(4);
    for (int step = 0; step < 200; ++step) {
      const bool overflow = rng() % 4 == 0 || (step > 100 && step < 130);
      copy_from_host(flag.pointer(), device(), &overflow, 1);
      scaler.update(flag.pointer());
      ref.update(overflow);
      const LossScalerState s = scaler.state();
      ASSERT_EQ(s.scale, static_cast<float>(ref.scale)) << "hysteresis " << hysteresis << " step " << step;
      ASSERT_EQ(s.growth_tracker, ref.growth) << step;
    }
  }
}

TEST_P(Scaler, FixedAndNoneModesNeverChange) {
  TestFlag inf(device(), true);
  LossScaler fixed(device(), {.mode = LossScaling::fixed, .initial_scale = 128.0f});
  LossScaler none(device(), {.mode = LossScaling::none});
  for (int i = 0; i < 5; ++i) {
    fixed.update(inf.pointer());
    none.update(inf.pointer());
  }
  EXPECT_EQ(fixed.state().scale, 128.0f);
  EXPECT_EQ(none.state().scale, 1.0f);
}

TEST_P(Scaler, RejectsBadOptions) {
  for (auto [field, o] : std::vector<std::pair<std::string, LossScalerOptions>>{
           {"growth_factor", {.growth_factor = 1.0f}},
           {"backoff_factor", {.backoff_factor = 1.0f}},
           {"growth_interval", {.growth_interval = 0}},
           {"hysteresis", {.hysteresis = 0}},
           {"initial_scale", {.initial_scale = -2.0f}}}) {
    try {
      LossScaler(device(), o);
      ADD_FAILURE() << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'options." + field + "'"), std::string::npos) << e.what();
    }
  }
}

// ---- the mixed-precision optimizer ----------------------------------------

struct HalfModel {
  std::vector<TestTensor> params, grads;
  DType dtype;
  HalfModel(Device device, uint64_t seed, DType d = DType::f16) : dtype(d) {
    std::mt19937_64 rng(seed);
    for (int64_t n : {3000, 65536 + 100, 33}) {
      params.emplace_back(device, d, random_values(rng, n));
      grads.emplace_back(device, d, random_values(rng, n));
    }
  }
  std::vector<AdamGroup> adam_groups(float weight_decay) const {
    AdamGroup g;
    g.hyperparameters.lr = 1e-2f;
    g.hyperparameters.weight_decay = weight_decay;
    for (size_t i = 0; i < params.size(); ++i) {
      g.params.push_back(params[i].view());
      g.grads.push_back(grads[i].view());
    }
    return {g};
  }
  // New scaled gradients (S times N(0, 1)), with optional poison.
  std::vector<std::vector<double>> set_gradients(Device device, std::mt19937_64& rng, double scale, double poison) {
    std::vector<std::vector<double>> out;
    for (size_t i = 0; i < grads.size(); ++i) {
      auto v = random_values(rng, grads[i].numel(), scale * 1e-3);
      if (i == 1 && poison != 0) v[12345] = poison;
      out.push_back(round_to(dtype, v));
      const auto bytes = TestTensor(device, dtype, out.back()).bytes();
      copy_from_host(grads[i].view().data, device, bytes.data(), bytes.size());
    }
    return out;
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& p : params) out.push_back(p.bytes());
    return out;
  }
};

using MixedPrecisionOptimizer = OnEachDevice;

// 40 steps with overflows injected (Inf, NaN, and a value past f16's range
// after scaling): the same steps are skipped, the scale follows GradScaler's
// rules, and the masters follow the float64 Adam reference with clipping.
TEST_P(MixedPrecisionOptimizer, FollowsGradScalerClipAndAdamW) {
  HalfModel model(device(), 5);
  MixedPrecisionOptions options;
  options.scaler.initial_scale = 1024.0f;
  options.scaler.growth_interval = 4;
  options.max_norm = 1.0f;
  MixedPrecisionAdam opt(model.adam_groups(0.01f), options);
  ReferenceScaler scaler(options.scaler);
  std::vector<AdamReferenceState> ref;
  for (const auto& p : model.params) {
    ref.push_back({p.read(), std::vector<double>(p.numel(), 0.0), std::vector<double>(p.numel(), 0.0), {}});
  }
  const AdamHyperparameters h = model.adam_groups(0.01f)[0].hyperparameters;
  std::mt19937_64 rng(6);
  int64_t t = 0;
  for (int step = 0; step < 40; ++step) {
    const double poison = step == 5 ? INFINITY : step == 12 ? NAN : step == 13 ? -INFINITY : 0.0;
    const double S = scaler.scale;
    const auto grads = model.set_gradients(device(), rng, S, poison);
    opt.step();
    bool overflow = false;
    for (const auto& g : grads) {
      for (double x : g) overflow = overflow || !std::isfinite(x);
    }
    ASSERT_EQ(opt.last_step_skipped(), overflow) << step;
    if (!overflow) {
      const double norm = reference_norm(grads, S, NormType::l2);
      const double divisor = S / std::min(options.max_norm / (norm + 1e-6), 1.0);
      ++t;
      for (size_t i = 0; i < ref.size(); ++i) reference_adam_step(ref[i], grads[i], h, t, divisor, DType::f32, DType::f32);
    }
    scaler.update(overflow);
    ASSERT_EQ(opt.loss_scale(), static_cast<float>(scaler.scale)) << step;
  }
  EXPECT_EQ(opt.optimizer().step_count(), t);
  for (size_t i = 0; i < ref.size(); ++i) {
    TestTensor master_copy(device(), DType::f32, std::vector<double>(opt.masters()[i].numel, 0.0));
    std::vector<double> masters(opt.masters()[i].numel);
    std::vector<float> f(masters.size());
    copy_to_host(f.data(), opt.masters()[i].data, f.size() * 4, device());
    for (size_t k = 0; k < f.size(); ++k) masters[k] = f[k];
    EXPECT_LE(relative_error(masters, ref[i].w), optimizer_tolerance(DType::f32, 40)) << i;
    EXPECT_EQ(model.params[i].read(), round_to(DType::f16, masters)) << "the model holds the rounded masters";
  }
}

TEST_P(MixedPrecisionOptimizer, AnOverflowStepWritesNothing) {
  HalfModel model(device(), 7, DType::bf16);
  MixedPrecisionAdam opt(model.adam_groups(0.0f));
  std::mt19937_64 rng(8);
  model.set_gradients(device(), rng, 1.0, 0.0);
  opt.step();
  const auto params = model.bits();
  std::vector<std::vector<uint8_t>> masters, moments;
  auto read = [&](const std::vector<TensorView>& list) {
    std::vector<std::vector<uint8_t>> out;
    for (const TensorView& t : list) {
      std::vector<uint8_t> b(t.bytes());
      copy_to_host(b.data(), t.data, b.size(), t.device);
      out.push_back(b);
    }
    return out;
  };
  masters = read(opt.masters());
  moments = read(opt.optimizer().exp_avg());
  model.set_gradients(device(), rng, 1.0, NAN);
  opt.step();
  EXPECT_TRUE(opt.last_step_skipped());
  EXPECT_EQ(model.bits(), params);
  EXPECT_EQ(read(opt.masters()), masters);
  EXPECT_EQ(read(opt.optimizer().exp_avg()), moments);
  EXPECT_EQ(opt.optimizer().step_count(), 1);
  EXPECT_EQ(opt.loss_scale(), 32768.0f);
}

TEST_P(MixedPrecisionOptimizer, SaveLoadRoundTripsBitExactly) {
  HalfModel model(device(), 9), resumed(device(), 10);  // resumed starts from other weights
  MixedPrecisionOptions options;
  options.scaler.growth_interval = 2;
  MixedPrecisionAdam a(model.adam_groups(0.01f), options);
  std::mt19937_64 rng(11), rng2(11);
  for (int s = 0; s < 5; ++s) {
    model.set_gradients(device(), rng, 65536.0, s == 2 ? INFINITY : 0.0);
    resumed.set_gradients(device(), rng2, 65536.0, s == 2 ? INFINITY : 0.0);
    a.step();
  }
  const std::string path = ::testing::TempDir() + "gradkit_mp_" + std::to_string(::getpid());
  a.save(path);
  MixedPrecisionAdam b(resumed.adam_groups(0.01f), options);
  b.load(path);
  EXPECT_EQ(resumed.bits(), model.bits()) << "load rewrites the model from the masters";
  for (int s = 0; s < 3; ++s) {
    model.set_gradients(device(), rng, 65536.0, 0.0);
    resumed.set_gradients(device(), rng2, 65536.0, 0.0);
    a.step();
    b.step();
  }
  EXPECT_EQ(resumed.bits(), model.bits());
  EXPECT_EQ(b.loss_scale(), a.loss_scale());
  std::remove(path.c_str());
}

// A hand-made 'scaler' section behind a valid checksum: refused, the
// model's weights, masters and scale left as they were.
TEST_P(MixedPrecisionOptimizer, RefusesABadScalerSectionWritingNothing) {
  HalfModel model(device(), 14);
  MixedPrecisionAdam opt(model.adam_groups(0.01f));
  std::mt19937_64 rng(15);
  model.set_gradients(device(), rng, 65536.0, 0.0);
  opt.step();
  const std::string path = ::testing::TempDir() + "gradkit_mp_scaler_" + std::to_string(::getpid());
  opt.save(path);
  model.set_gradients(device(), rng, 65536.0, INFINITY);
  opt.step();  // skipped: the scale backs off, the file keeps the old one
  std::vector<RawSection> sections = read_raw_sections(path);
  std::vector<uint8_t>& scaler = find_section(sections, "scaler").bytes;  // f32 scale, i32 growth, i32 hysteresis left
  const std::vector<uint8_t> good = scaler;
  auto expect_refused = [&](const std::string& fragment) {
    write_raw_state_file(path, sections);
    const auto weights = model.bits();
    expect_error([&] { opt.load(path); }, ErrorCode::io_error, {path, fragment});
    EXPECT_EQ(model.bits(), weights);
    EXPECT_EQ(opt.loss_scale(), 32768.0f);
    scaler = good;
  };
  scaler.push_back(0);
  expect_refused("section 'scaler' has trailing bytes");
  put_at<float>(scaler, 0, NAN);
  expect_refused("has a bad loss scaler state: LossScaler: argument 'state.scale' is nan");
  put_at<int32_t>(scaler, 8, 0);
  expect_refused("'state.hysteresis_left' is 0, expected an integer in [1, hysteresis]");
  std::remove(path.c_str());
}

TEST_P(MixedPrecisionOptimizer, LambVariantSkipsAndSteps) {
  HalfModel model(device(), 12);
  LambGroup g;
  g.hyperparameters.lambda = 0.01f;
  for (size_t i = 0; i < model.params.size(); ++i) {
    g.params.push_back(model.params[i].view());
    g.grads.push_back(model.grads[i].view());
  }
  MixedPrecisionLamb opt({g}, {}, LambOptions{.eta = 0.01f});
  std::mt19937_64 rng(13);
  const auto before = model.bits();
  model.set_gradients(device(), rng, 65536.0, INFINITY);
  opt.step();
  EXPECT_TRUE(opt.last_step_skipped());
  EXPECT_EQ(model.bits(), before);
  model.set_gradients(device(), rng, 32768.0, 0.0);
  opt.step();
  EXPECT_FALSE(opt.last_step_skipped());
  EXPECT_NE(model.bits(), before);
  EXPECT_EQ(opt.optimizer().step_count(), 1);
}

TEST_P(MixedPrecisionOptimizer, RejectsF32Params) {
  TestTensor p(device(), DType::f32, {1.0, 2.0}), g(device(), DType::f32, {1.0, 2.0});
  AdamGroup group;
  group.params = {p.view()};
  group.grads = {g.view()};
  try {
    MixedPrecisionAdam opt({group});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'groups[0].params[0]'"), std::string::npos) << e.what();
  }
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(GradientCheck);
GRADKIT_INSTANTIATE_ON_EACH_DEVICE(Scaler);
GRADKIT_INSTANTIATE_ON_EACH_DEVICE(MixedPrecisionOptimizer);

}  // namespace
}  // namespace gradkit::test
