// OffloadedLamb: LAMB's own argument checks (run anywhere: they come before
// any device is touched; the checks it shares with OffloadedAdam are in
// test_offloaded.cc), and on a GPU the offloaded step against gradkit's LAMB
// on the GPU, bit for bit, over 50 steps with Inf/NaN gradients, loss
// scaling and clipping; a resume through its state file; and the file moving
// between the offloaded and the GPU optimizer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/offloaded.h"
#include "support/expect_error.h"
#include "support/offload_model.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

// ---- argument checks (no device needed) ------------------------------------

// Host memory that the views below call device memory: the checks must
// refuse the call before anything looks at it, and leave it as it was.
struct FakeModel {
  std::vector<float> memory = std::vector<float>(64, 1.5f);
  TensorView at(int offset, int64_t numel, DType dtype = DType::f32) {
    return TensorView{memory.data() + offset, numel, dtype, Device::cuda(0)};
  }
  LambGroup group() {
    LambGroup g;
    g.params = {at(0, 8), at(8, 8)};
    g.grads = {at(16, 8), at(24, 8)};
    return g;
  }
  bool untouched() const {
    for (float v : memory) if (v != 1.5f) return false;
    return true;
  }
};

void expect_refused(std::vector<LambGroup> groups, OffloadedOptions options, ErrorCode code,
                    const std::vector<std::string>& parts) {
  expect_error([&] { OffloadedLamb(std::move(groups), std::move(options)); }, code, parts);
}

TEST(OffloadedLambArguments, LambsOwnArgumentsAreChecked) {
  FakeModel m;
  OffloadedOptions o;
  o.lamb.moment_dtype = DType::f16;
  expect_refused({m.group()}, o, ErrorCode::dtype_unsupported, {"OffloadedLamb", "options.lamb.moment_dtype", "f16"});
  o = {};
  o.adam.moment_dtype = DType::f16;  // Adam's options are not LAMB's: ignored
  o.lamb.eta = -1.0f;
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"OffloadedLamb", "options.lamb.eta", "-1"});
  o.lamb.eta = INFINITY;
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"options.lamb.eta"});
  LambGroup g = m.group();
  g.hyperparameters.beta = 1.0f;
  expect_refused({g}, {}, ErrorCode::invalid_argument, {"groups[0].hyperparameters", "beta"});
  g = m.group();
  g.weight_remainder = {m.at(32, 8, DType::i16), m.at(40, 8, DType::i16)};
  expect_refused({g}, {}, ErrorCode::invalid_argument, {"groups[0].weight_remainder", "expected none"});
  g = m.group();
  g.params[0].device = Device::cpu();
  expect_refused({g}, {}, ErrorCode::device_mismatch, {"OffloadedLamb", "groups[0].params[0]", "is on cpu"});
  EXPECT_TRUE(m.untouched());
}

// Valid arguments where CUDA cannot be used (no GPU, or a build without
// CUDA): refused as such, after the argument checks.
TEST(OffloadedLambArguments, WithoutAGpuTheOptimizerIsRefused) {
  if (cuda_available()) GTEST_SKIP() << "a CUDA device is visible";
  FakeModel m;
  expect_refused({m.group()}, {}, ErrorCode::backend_unavailable, {"OffloadedLamb", "CUDA"});
  EXPECT_TRUE(m.untouched());
}

// ---- on a GPU: the offloaded step against the GPU step --------------------

class OffloadedLambGpu : public ::testing::TestWithParam<OffloadConfig> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
};

TEST_P(OffloadedLambGpu, FiftyStepsEqualTheGpuStepBitForBit) {
  const OffloadConfig c = GetParam();
  OffloadModel a(c, 7), b(c, 7);
  OffloadedLamb off(a.groups<LambGroup>(a.weights()), offload_options(c));
  GpuStep<Lamb> gpu(b);
  int skipped = 0;
  for (int s = 1; s <= 50; ++s) {
    a.write_gradients(s);
    b.write_gradients(s);
    offloaded_step(off);
    gpu.step();
    ASSERT_EQ(bits(a.weights()), bits(b.weights())) << "weights differ after step " << s;
    if (c.check) {
      ASSERT_EQ(off.last_step_skipped(), gpu.skipped()) << "step " << s;
      skipped += gpu.skipped();
    }
  }
  EXPECT_EQ(skipped, c.check ? 3 : 0);
  EXPECT_EQ(off.step_count(), gpu.optimizer->step_count());
  EXPECT_EQ(off.step_count(), c.check ? 47 : 50);
  EXPECT_EQ(bits(off.host_optimizer().exp_avg()), bits(gpu.optimizer->exp_avg()));
  EXPECT_EQ(bits(off.host_optimizer().exp_avg_sq()), bits(gpu.optimizer->exp_avg_sq()));
  EXPECT_EQ(bits(off.host_optimizer().exp_avg_absmax()), bits(gpu.optimizer->exp_avg_absmax()));
  EXPECT_EQ(bits(off.masters()), bits(gpu.masters));
  if (c.check) EXPECT_EQ(off.scaler()->state().scale, gpu.scaler->state().scale);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OffloadedLambGpu,
                         ::testing::Values(OffloadConfig{DType::f32, DType::f32, false},
                                           OffloadConfig{DType::f32, DType::bf16, true},
                                           OffloadConfig{DType::bf16, DType::bf16, false},
                                           OffloadConfig{DType::bf16, DType::f32, true},
                                           OffloadConfig{DType::f16, DType::f16, true},
                                           // 1000-element pieces: each tensor a piece of its own
                                           OffloadConfig{DType::f32, DType::f32, false, 4000},
                                           OffloadConfig{DType::bf16, DType::f32, true, 4000, DType::u8},
                                           OffloadConfig{DType::f32, DType::bf16, false, 3000, DType::u8}),
                         [](const auto& info) { return config_name(info.param); });

// 20 steps straight equal 10 steps, a save, a new optimizer loading it, and
// 10 more.
TEST_P(OffloadedLambGpu, AResumedRunEqualsTheStraightRun) {
  const OffloadConfig c = GetParam();
  OffloadModel straight(c, 11), resumed(c, 11);
  OffloadedLamb a(straight.groups<LambGroup>(straight.weights()), offload_options(c));
  const std::string path = offload_temp_path("lamb_resume");
  {
    OffloadedLamb first(resumed.groups<LambGroup>(resumed.weights()), offload_options(c));
    for (int s = 1; s <= 10; ++s) {
      resumed.write_gradients(s);
      offloaded_step(first);
    }
    first.save(path);
  }
  for (int s = 1; s <= 10; ++s) {
    straight.write_gradients(s);
    offloaded_step(a);
  }
  OffloadedLamb second(resumed.groups<LambGroup>(resumed.weights()), offload_options(c));
  second.load(path);
  EXPECT_EQ(second.step_count(), a.step_count());
  for (int s = 11; s <= 20; ++s) {
    straight.write_gradients(s);
    resumed.write_gradients(s);
    offloaded_step(a);
    offloaded_step(second);
  }
  EXPECT_EQ(bits(straight.weights()), bits(resumed.weights()));
  EXPECT_EQ(a.step_count(), second.step_count());
  EXPECT_EQ(bits(a.host_optimizer().exp_avg_sq()), bits(second.host_optimizer().exp_avg_sq()));
  std::remove(path.c_str());
}

TEST(OffloadedLambState, FilesMoveBetweenTheOffloadedAndTheGpuOptimizer) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const std::string path = offload_temp_path("lamb_cross");
  // f32 weights: Lamb's file, both ways; eta and step count travel with it.
  {
    const OffloadConfig c{DType::f32, DType::f32, false};
    OffloadModel a(c, 3), b(c, 3);
    OffloadedLamb off(a.groups<LambGroup>(a.weights()), offload_options(c));
    off.set_eta(2e-3f);
    GpuStep<Lamb> gpu(b);
    for (int s = 1; s <= 4; ++s) {
      a.write_gradients(s);
      offloaded_step(off);
    }
    off.save(path);
    for (size_t i = 0; i < a.w.size(); ++i) fill(b.w[i].view(), a.w[i].read());
    gpu.optimizer->load(path);
    EXPECT_EQ(gpu.optimizer->eta(), 2e-3f);
    step_both(a, off, b, [&] { gpu.step(); }, 5, 8);
    EXPECT_EQ(bits(a.weights()), bits(b.weights()));
    gpu.optimizer->save(path);
    OffloadedLamb back(a.groups<LambGroup>(a.weights()), offload_options(c));
    back.load(path);
    EXPECT_EQ(back.step_count(), 8);
    EXPECT_EQ(back.eta(), 2e-3f);
    EXPECT_EQ(bits(back.host_optimizer().exp_avg()), bits(gpu.optimizer->exp_avg()));
  }
  // bf16 weights with a scaler: MixedPrecisionLamb's file, both ways.
  {
    const OffloadConfig c{DType::bf16, DType::bf16, true};
    OffloadModel a(c, 4), b(c, 4);
    const OffloadedOptions o = offload_options(c);
    OffloadedLamb off(a.groups<LambGroup>(a.weights()), o);
    MixedPrecisionOptions mo;
    mo.scaler = *o.scaler;
    mo.max_norm = o.max_norm;
    MixedPrecisionLamb mixed(b.groups<LambGroup>(b.weights()), mo);
    for (int s = 1; s <= 6; ++s) {
      a.write_gradients(s);
      offloaded_step(off);
    }
    off.save(path);
    mixed.load(path);  // writes b's weights from the masters
    EXPECT_EQ(bits(a.weights()), bits(b.weights()));
    step_both(a, off, b, [&] { mixed.step(); }, 7, 12);
    EXPECT_EQ(bits(a.weights()), bits(b.weights()));
    EXPECT_EQ(off.scaler()->state().scale, mixed.loss_scale());
    mixed.save(path);
    OffloadModel fresh(c, 99);
    OffloadedLamb back(fresh.groups<LambGroup>(fresh.weights()), o);
    back.load(path);
    EXPECT_EQ(bits(fresh.weights()), bits(b.weights()));
    EXPECT_EQ(bits(back.masters()), bits(mixed.masters()));
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace gradkit::test
