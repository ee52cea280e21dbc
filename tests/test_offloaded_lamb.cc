// OffloadedLamb: LAMB's own argument checks (run anywhere: they come before
// any device is touched; the checks it shares with OffloadedAdam are in
// test_offloaded.cc), and on a GPU the offloaded step over 50 steps with
// Inf/NaN gradients, loss scaling and clipping against the host LAMB (bit
// for bit) and gradkit's LAMB on the GPU (bit for bit with 8-bit moments, to
// rounding with float moments); a resume through its state file; and the
// file moving between the offloaded and the GPU optimizer.
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
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

// ---- argument checks (no device needed) ------------------------------------

void expect_refused(std::vector<LambGroup> groups, OffloadedOptions options, ErrorCode code,
                    const std::vector<std::string>& parts) {
  test::expect_refused<Lamb>(std::move(groups), std::move(options), code, parts);
}

TEST(OffloadedLambArguments, LambsOwnArgumentsAreChecked) {
  FakeModel m;
  OffloadedOptions o;
  o.lamb.moment_dtype = DType::f16;
  expect_refused({m.group<LambGroup>()}, o, ErrorCode::dtype_unsupported, {"OffloadedLamb", "options.lamb.moment_dtype", "f16"});
  o = {};
  o.adam.moment_dtype = DType::f16;  // Adam's options are not LAMB's: ignored
  try {
    OffloadedLamb(std::vector<LambGroup>{m.group<LambGroup>()}, o);
  } catch (const Error& e) {  // no GPU: backend_unavailable; a GPU: the fake model's host memory
    EXPECT_EQ(std::string(e.what()).find("moment_dtype"), std::string::npos) << e.what();
    EXPECT_TRUE(e.code() == ErrorCode::backend_unavailable || e.code() == ErrorCode::device_mismatch) << e.what();
  }
  o.lamb.eta = -1.0f;
  expect_refused({m.group<LambGroup>()}, o, ErrorCode::invalid_argument, {"OffloadedLamb", "options.lamb.eta", "-1"});
  o.lamb.eta = INFINITY;
  expect_refused({m.group<LambGroup>()}, o, ErrorCode::invalid_argument, {"options.lamb.eta"});
  LambGroup g = m.group<LambGroup>();
  g.hyperparameters.beta = 1.0f;
  expect_refused({g}, {}, ErrorCode::invalid_argument, {"groups[0].hyperparameters", "beta"});
  g = m.group<LambGroup>();
  g.weight_remainder = {m.at(32, 8, DType::i16), m.at(40, 8, DType::i16)};
  expect_refused({g}, {}, ErrorCode::invalid_argument, {"groups[0].weight_remainder", "expected none"});
  g = m.group<LambGroup>();
  g.params[0].device = Device::cpu();
  expect_refused({g}, {}, ErrorCode::device_mismatch, {"OffloadedLamb", "groups[0].params[0]", "is on cpu"});
  EXPECT_TRUE(m.untouched());
}

// Valid arguments where CUDA cannot be used (no GPU, or a build without
// CUDA): refused as such, after the argument checks.
TEST(OffloadedLambArguments, WithoutAGpuTheOptimizerIsRefused) {
  if (cuda_available()) GTEST_SKIP() << "a CUDA device is visible";
  FakeModel m;
  expect_refused({m.group<LambGroup>()}, {}, ErrorCode::backend_unavailable, {"OffloadedLamb", "CUDA"});
  EXPECT_TRUE(m.untouched());
}

// ---- on a GPU: the offloaded step against the GPU step --------------------

// f32 tensors anywhere, as float64 values one after another.
std::vector<double> f32_values(const std::vector<TensorView>& tensors) {
  std::vector<double> out;
  for (const TensorView& t : tensors) {
    std::vector<float> v(static_cast<size_t>(t.numel));
    copy_to_host(v.data(), t.data, t.bytes(), t.device);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

class OffloadedLambGpu : public OffloadGpuTest {};

// The offloaded step is the host LAMB's bit for bit (HostStep: the same
// plans' arithmetic over whole tensors, whatever the pieces). Against the
// GPU's LAMB: bit for bit with 8-bit moments, whose norms both backends sum
// alike; to rounding with float moments, whose per-chunk sums are f64 on the
// CPU and f32 on the GPU (docs/ops.md).
TEST_P(OffloadedLambGpu, FiftyStepsEqualTheHostStepBitForBitAndTheGpuStep) {
  const OffloadConfig c = GetParam();
  const bool gpu_bitwise = c.moments == DType::u8;  // 8- or 4-bit
  OffloadModel a(c, 7), h(c, 7), b(c, 7);
  OffloadedLamb off(a.groups<LambGroup>(a.weights()), offload_options(c));
  HostStep<Lamb> host(h);
  GpuStep<Lamb> gpu(b);
  int skipped = 0;
  for (int s = 1; s <= 50; ++s) {
    for (OffloadModel* m : {&a, &h, &b}) m->write_gradients(s);
    offloaded_step(off);
    host.step();
    gpu.step();
    ASSERT_EQ(bits(a.weights()), bits(h.weights())) << "weights differ from the host step's after step " << s;
    if (gpu_bitwise) ASSERT_EQ(bits(a.weights()), bits(b.weights())) << "weights differ after step " << s;
    if (c.check) {
      ASSERT_EQ(off.last_step_skipped(), gpu.skipped()) << "step " << s;
      ASSERT_EQ(off.last_step_skipped(), host.found_inf) << "step " << s;
      skipped += gpu.skipped();
    }
  }
  EXPECT_EQ(skipped, c.check ? 3 : 0);
  EXPECT_EQ(off.step_count(), host.optimizer->step_count());
  EXPECT_EQ(off.step_count(), gpu.optimizer->step_count());
  EXPECT_EQ(off.step_count(), c.check ? 47 : 50);
  EXPECT_EQ(bits(off.host_optimizer().exp_avg()), bits(host.optimizer->exp_avg()));
  EXPECT_EQ(bits(off.host_optimizer().exp_avg_sq()), bits(host.optimizer->exp_avg_sq()));
  EXPECT_EQ(bits(off.masters()), bits(host.master_views()));
  if (gpu_bitwise) {
    EXPECT_EQ(bits(off.host_optimizer().exp_avg()), bits(gpu.optimizer->exp_avg()));
    EXPECT_EQ(bits(off.host_optimizer().exp_avg_absmax()), bits(gpu.optimizer->exp_avg_absmax()));
    EXPECT_EQ(bits(off.masters()), bits(gpu.masters));
  }
  // Float moments: the GPU's masters within the optimizer tolerance of 50 f32 steps.
  EXPECT_LE(relative_error(f32_values(off.masters()), f32_values(gpu.masters)), optimizer_tolerance(DType::f32, 50));
  if (c.check) EXPECT_EQ(off.scaler()->state().scale, gpu.scaler->state().scale);
}

// Release: each bucket handed twice a step, the second hand added on the
// host, equals the host step over the doubled gradients (exact): bit for bit
// without a check; with one (on the host, over the staged sums) the same skips.
TEST_P(OffloadedLambGpu, ReleaseAddsALaterHandOnTheHost) {
  const OffloadConfig c = GetParam();
  OffloadModel a(c, 7), h(c, 7);
  OffloadedLamb off(a.groups<LambGroup>(a.weights()), release_options(c));
  HostStep<Lamb> host(h);
  for (int s = 1; s <= 12; ++s) {
    a.write_gradients(s);
    h.write_gradients(s, 2.0);
    step_handing_twice(off, 1);
    host.step();
    if (c.check) ASSERT_EQ(off.last_step_skipped(), host.found_inf) << "step " << s;
    else ASSERT_EQ(bits(a.weights()), bits(h.weights())) << "weights differ after step " << s;
  }
  EXPECT_EQ(off.step_count(), host.optimizer->step_count());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OffloadedLambGpu, ::testing::ValuesIn(kOffloadConfigs),
                         [](const auto& info) { return config_name(info.param); });
INSTANTIATE_TEST_SUITE_P(FourBit, OffloadedLambGpu, ::testing::ValuesIn(kOffload4BitConfigs),
                         [](const auto& info) { return config_name(info.param); });

TEST_P(OffloadedLambGpu, AResumedRunEqualsTheStraightRun) {
  expect_a_resumed_run_equals_the_straight_run<Lamb>(GetParam());
}

TEST(OffloadedLambState, FilesMoveBetweenTheOffloadedAndTheGpuOptimizer) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const std::string path = offload_temp_path("lamb_cross");
  // f32 weights: Lamb's file, both ways; eta and step count travel with it.
  // 8-bit moments, so that the two backends' steps agree bit for bit (with
  // float moments their norms differ in rounding).
  {
    const OffloadConfig c{DType::f32, DType::f32, false, OffloadedOptions{}.piece_bytes, DType::u8};
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
  const OffloadConfig eight_bit{DType::bf16, DType::bf16, true, OffloadedOptions{}.piece_bytes, DType::u8};
  expect_the_mixed_precision_file_moves_both_ways<Lamb>(eight_bit, path);
  // Float moments: the file moves both ways and loads back what was saved.
  {
    const OffloadConfig c{DType::bf16, DType::f32, true};
    OffloadModel a(c, 5), b(c, 5);
    const OffloadedOptions o = offload_options(c);
    OffloadedLamb off(a.groups<LambGroup>(a.weights()), o);
    for (int s = 1; s <= 3; ++s) {
      a.write_gradients(s);
      offloaded_step(off);
    }
    off.save(path);
    MixedPrecisionOptions mo;
    mo.scaler = *o.scaler;
    mo.max_norm = o.max_norm;
    MixedPrecisionLamb mixed(b.groups<LambGroup>(b.weights()), mo);
    mixed.load(path);
    EXPECT_EQ(bits(mixed.optimizer().exp_avg_sq()), bits(off.host_optimizer().exp_avg_sq()));
    EXPECT_EQ(bits(mixed.masters()), bits(off.masters()));
    mixed.save(path);
    OffloadedLamb back(b.groups<LambGroup>(b.weights()), o);
    back.load(path);
    EXPECT_EQ(back.step_count(), 3);
    EXPECT_EQ(bits(back.host_optimizer().exp_avg()), bits(off.host_optimizer().exp_avg()));
    EXPECT_EQ(bits(back.masters()), bits(off.masters()));
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace gradkit::test
