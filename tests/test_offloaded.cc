// OffloadedAdam: the argument checks (run anywhere: they come before any
// device is touched), how buckets are cut into pieces, and on a GPU the
// offloaded step against gradkit's step on the GPU, bit for bit, over 50
// steps with Inf/NaN gradients, loss scaling and clipping, and a resume
// through its state file. OffloadedLamb: test_offloaded_lamb.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/offloaded.h"
#include "optim/offloaded_parts.h"  // cut_pieces
#include "support/expect_error.h"
#include "support/offload_model.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

// ---- argument checks (no device needed) ------------------------------------

void expect_refused(std::vector<AdamGroup> groups, OffloadedOptions options, ErrorCode code,
                    const std::vector<std::string>& parts) {
  test::expect_refused<Adam>(std::move(groups), std::move(options), code, parts);
}

TEST(OffloadedAdamArguments, ParamsOnTheHostAreRefused) {
  FakeModel m;
  AdamGroup g = m.group();
  for (TensorView& t : g.params) t.device = Device::cpu();
  for (TensorView& t : g.grads) t.device = Device::cpu();
  expect_refused({g}, {}, ErrorCode::device_mismatch, {"groups[0].params[0]", "is on cpu", "CUDA device"});
  EXPECT_TRUE(m.untouched());
}

TEST(OffloadedAdamArguments, MixedDevicesAreRefused) {
  FakeModel m;
  AdamGroup g = m.group();
  g.params[1].device = Device::cuda(1);
  expect_refused({g}, {}, ErrorCode::device_mismatch, {"groups[0].params[1]", "cuda:1", "expected cuda:0"});
  g = m.group();
  g.grads[1].device = Device::cpu();
  expect_refused({g}, {}, ErrorCode::device_mismatch, {"groups[0].grads[1]", "is on cpu", "expected cuda:0"});
  AdamGroup second = m.group();  // a second group on another device
  for (TensorView& t : second.params) t.device = Device::cuda(2);
  expect_refused({m.group(), second}, {}, ErrorCode::device_mismatch, {"groups[1].params[0]", "cuda:2"});
  EXPECT_TRUE(m.untouched());
}

TEST(OffloadedAdamArguments, UnsupportedDtypesAreRefused) {
  FakeModel m;
  AdamGroup g = m.group();
  for (TensorView& t : g.params) t.dtype = DType::f64, t.numel = 4;
  expect_refused({g}, {}, ErrorCode::dtype_unsupported, {"groups[0].params[0]", "f64", "expected f32, f16 or bf16"});
  g = m.group();
  for (TensorView& t : g.grads) t.dtype = DType::u8;
  expect_refused({g}, {}, ErrorCode::dtype_unsupported, {"groups[0].grads[0]", "u8"});
  g = m.group();
  g.params[1].dtype = DType::bf16;
  expect_refused({g}, {}, ErrorCode::dtype_unsupported, {"groups[0].params[1]", "bf16", "one dtype per list"});
  OffloadedOptions o;
  o.adam.moment_dtype = DType::f16;
  expect_refused({m.group()}, o, ErrorCode::dtype_unsupported, {"options.adam.moment_dtype", "f16"});
  EXPECT_TRUE(m.untouched());
}

TEST(OffloadedAdamArguments, BadGroupsAndOptionsAreRefused) {
  FakeModel m;
  expect_refused({}, {}, ErrorCode::invalid_argument, {"groups", "is empty"});
  AdamGroup g = m.group();
  g.grads.pop_back();
  expect_refused({g}, {}, ErrorCode::size_mismatch, {"groups[0].grads", "has 1 tensors, expected 2"});
  g = m.group();
  g.model_copy = {m.at(32, 8, DType::bf16), m.at(40, 8, DType::bf16)};
  expect_refused({g}, {}, ErrorCode::invalid_argument, {"groups[0].model_copy", "expected none"});
  g = m.group();
  g.hyperparameters.beta1 = 1.0f;
  expect_refused({g}, {}, ErrorCode::invalid_argument, {"groups[0].hyperparameters", "beta1"});
  OffloadedOptions o;
  o.max_norm = -1.0f;
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"options.max_norm", "expected a finite value >= 0"});
  o = {};
  o.buckets = {0};
  expect_refused({m.group()}, o, ErrorCode::size_mismatch, {"options.buckets", "has 1 entries, expected 2"});
  o.buckets = {0, -1};
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"options.buckets[1]", "is -1"});
  o.buckets = {0, 2};
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"options.buckets", "no tensor for bucket 1"});
  o = {};
  o.host_threads = -1;
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"options.host_threads", "expected >= 0"});
  o = {};
  o.bucket_bytes = 0;
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"options.bucket_bytes", "expected > 0"});
  o = {};
  o.piece_bytes = 0;
  expect_refused({m.group()}, o, ErrorCode::invalid_argument, {"options.piece_bytes", "expected > 0"});
  EXPECT_TRUE(m.untouched());
}

// Valid arguments where CUDA cannot be used (no GPU, or a build without
// CUDA): refused as such, after the argument checks.
TEST(OffloadedAdamArguments, WithoutAGpuTheOptimizerIsRefused) {
  if (cuda_available()) GTEST_SKIP() << "a CUDA device is visible";
  FakeModel m;
  expect_refused({m.group()}, {}, ErrorCode::backend_unavailable, {"OffloadedAdam", "CUDA"});
  EXPECT_TRUE(m.untouched());
}

// Pinned memory that cannot be had (no GPU, no CUDA, or more than the
// machine can lock) is a clear error naming the size.
TEST(PinnedBuffer, AFailedAllocationIsAClearError) {
  const size_t huge = size_t{1} << 52;
  try {
    Buffer b = Buffer::pinned(huge);
    ADD_FAILURE() << "allocated 4 PiB of pinned memory";
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == ErrorCode::cuda_error || e.code() == ErrorCode::backend_unavailable) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(huge) + " bytes of pinned host memory"), std::string::npos)
        << e.what();
  }
  expect_error([] { Buffer::pinned(~size_t{0}); }, ErrorCode::invalid_argument, {"Buffer::pinned", "cannot allocate"});
}

// ---- how a bucket is cut into pieces (no GPU needed) -----------------------

TEST(OffloadPieces, EveryElementLiesInOneSliceAndCutsKeepBlocksWhole) {
  const int64_t sizes[] = {1000, 65536 * 2 + 1, 3, 256, 0, 4097, 7, 300000};
  std::vector<TensorView> grads;
  for (size_t i = 0; i < std::size(sizes); ++i) grads.push_back({nullptr, sizes[i], i % 2 ? DType::bf16 : DType::f32});
  const std::vector<size_t> bucket = {0, 1, 2, 3, 4, 5, 6, 7};
  for (size_t piece_bytes : {size_t{1}, size_t{1000}, size_t{4000}, size_t{65536}, size_t{8} << 20}) {
    const auto pieces = cut_pieces(bucket, grads, piece_bytes, 256);
    std::vector<int64_t> next(std::size(sizes), 0);  // each tensor's next uncovered element
    for (const auto& piece : pieces) {
      ASSERT_FALSE(piece.empty()) << "piece_bytes " << piece_bytes;
      size_t bytes = 0;
      for (const OffloadSlice& s : piece) {
        ASSERT_EQ(s.offset, next[s.tensor]) << "tensor " << s.tensor << ", piece_bytes " << piece_bytes;
        EXPECT_GT(s.count, 0);
        EXPECT_EQ(s.offset % 256, 0) << "a cut inside an 8-bit block";
        next[s.tensor] += s.count;
        bytes += static_cast<size_t>(s.count) * dtype_size(grads[s.tensor].dtype);
      }
      // Over the target only by what one block (the least a piece takes) adds.
      EXPECT_LE(bytes, std::max(piece_bytes, size_t{256} * 4) + 256 * 4) << "piece_bytes " << piece_bytes;
    }
    for (size_t t = 0; t < std::size(sizes); ++t) EXPECT_EQ(next[t], sizes[t]) << "tensor " << t;
    if (piece_bytes == (size_t{8} << 20)) EXPECT_EQ(pieces.size(), 1u);  // the whole bucket fits in one
    if (piece_bytes == 4000) EXPECT_GT(pieces.size(), 100u);
  }
}

// LAMB's pieces (align 0): whole tensors, in order, a piece closed before a
// tensor that would overflow it; a tensor larger than a piece is one alone.
TEST(OffloadPieces, WithAlignZeroEveryTensorStaysWhole) {
  const int64_t sizes[] = {1000, 65536 * 2 + 1, 3, 256, 0, 4097, 7, 300000};
  std::vector<TensorView> grads;
  for (int64_t n : sizes) grads.push_back({nullptr, n, DType::f32});
  const std::vector<size_t> bucket = {0, 1, 2, 3, 4, 5, 6, 7};
  for (size_t piece_bytes : {size_t{1}, size_t{5000}, size_t{20000}, size_t{8} << 20}) {
    const auto pieces = cut_pieces(bucket, grads, piece_bytes, 0);
    size_t next = 0;
    for (const auto& piece : pieces) {
      ASSERT_FALSE(piece.empty());
      size_t bytes = 0;
      for (const OffloadSlice& s : piece) {
        if (sizes[next] == 0) ++next;  // an empty tensor needs no slice
        ASSERT_EQ(s.tensor, next) << "piece_bytes " << piece_bytes;
        EXPECT_EQ(s.offset, 0);
        EXPECT_EQ(s.count, sizes[next]) << "tensor " << next << " was cut";
        bytes += static_cast<size_t>(s.count) * 4;
        ++next;
      }
      EXPECT_TRUE(piece.size() == 1 || bytes <= piece_bytes) << "piece_bytes " << piece_bytes;
    }
    EXPECT_EQ(next, std::size(sizes));
    if (piece_bytes == 1) EXPECT_EQ(pieces.size(), 7u);  // one tensor each
    if (piece_bytes == (size_t{8} << 20)) EXPECT_EQ(pieces.size(), 1u);
  }
}

// ---- on a GPU: the offloaded step against the GPU step --------------------

using Config = OffloadConfig;
using Model = OffloadModel;

class OffloadedAdamGpu : public OffloadGpuTest {};

TEST_P(OffloadedAdamGpu, FiftyStepsEqualTheGpuStepBitForBit) {
  const Config c = GetParam();
  Model a(c, 7), b(c, 7);
  OffloadedAdam off(a.groups<AdamGroup>(a.weights()), offload_options(c));
  GpuStep<Adam> gpu(b);
  int skipped = 0;
  for (int s = 1; s <= 50; ++s) {
    a.write_gradients(s);
    b.write_gradients(s);
    offloaded_step(off);
    gpu.step();
    ASSERT_EQ(bits(a.weights()), bits(b.weights())) << "weights differ after step " << s;
    if (c.check) {
      const bool gpu_skipped = gpu.skipped();
      ASSERT_EQ(off.last_step_skipped(), gpu_skipped) << "step " << s;
      skipped += gpu_skipped;
    }
  }
  EXPECT_EQ(skipped, c.check ? 3 : 0);
  const OffloadStepTimes t = off.last_step_times();  // the worker's own account of the last step
  EXPECT_GT(t.update_ms, 0.0);
  EXPECT_GE(t.copy_wait_ms, 0.0);
  EXPECT_GE(t.span_ms, t.copy_wait_ms + t.update_ms);
  EXPECT_EQ(off.step_count(), gpu.optimizer->step_count());
  EXPECT_EQ(off.step_count(), c.check ? 47 : 50);
  EXPECT_EQ(bits(off.host_optimizer().exp_avg()), bits(gpu.optimizer->exp_avg()));
  EXPECT_EQ(bits(off.host_optimizer().exp_avg_sq()), bits(gpu.optimizer->exp_avg_sq()));
  EXPECT_EQ(bits(off.masters()), bits(gpu.masters));
  if (c.check) EXPECT_EQ(off.scaler()->state().scale, gpu.scaler->state().scale);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OffloadedAdamGpu, ::testing::ValuesIn(kOffloadConfigs),
                         [](const auto& info) { return config_name(info.param); });
INSTANTIATE_TEST_SUITE_P(FourBit, OffloadedAdamGpu, ::testing::ValuesIn(kOffload4BitConfigs),
                         [](const auto& info) { return config_name(info.param); });

// Release: each bucket handed twice a step (micro-batches), the second hand
// added on the host, equals the GPU step over the sum (the same gradients
// twice: their doubles, exactly). Without a check, bit for bit; with one (run
// on the host over the staged sums), the same skips and scales, the norm to
// rounding (its f64 partials are added piece by piece).
TEST_P(OffloadedAdamGpu, ReleaseAddsALaterHandOnTheHost) {
  const Config c = GetParam();
  Model a(c, 7), b(c, 7);
  OffloadedAdam off(a.groups<AdamGroup>(a.weights()), release_options(c));
  GpuStep<Adam> gpu(b);
  for (int s = 1; s <= 12; ++s) {
    a.write_gradients(s);
    b.write_gradients(s, 2.0);
    step_handing_twice(off, 0);
    gpu.step();
    if (!c.check) {
      ASSERT_EQ(bits(a.weights()), bits(b.weights())) << "weights differ after step " << s;
      continue;
    }
    ASSERT_EQ(off.last_step_skipped(), gpu.skipped()) << "step " << s;
    ASSERT_EQ(off.scaler()->state().scale, gpu.scaler->state().scale) << "step " << s;
    if (!gpu.skipped()) {
      float norm = 0;
      copy_to_host(&norm, gpu.divisor() + 1, sizeof norm, Device::cuda(0));
      EXPECT_NEAR(off.last_grad_norm(), norm, 1e-6 * norm) << "step " << s;
    }
  }
  EXPECT_EQ(off.step_count(), gpu.optimizer->step_count());
  EXPECT_EQ(off.device_bytes(), c.check ? sizeof(OffloadScalars) + sizeof(LossScalerState) : 0u);
}

TEST_P(OffloadedAdamGpu, AResumedRunEqualsTheStraightRun) {
  expect_a_resumed_run_equals_the_straight_run<Adam>(GetParam());
}

TEST(OffloadedAdamState, FilesMoveBetweenTheOffloadedAndTheGpuOptimizer) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const std::string path = offload_temp_path("cross");
  // f32 weights: Adam's file, both ways.
  {
    const Config c{DType::f32, DType::f32, false};
    Model a(c, 3), b(c, 3);
    OffloadedAdam off(a.groups<AdamGroup>(a.weights()), offload_options(c));
    GpuStep<Adam> gpu(b);
    for (int s = 1; s <= 4; ++s) {
      a.write_gradients(s);
      offloaded_step(off);
    }
    off.save(path);
    for (size_t i = 0; i < a.w.size(); ++i) fill(b.w[i].view(), a.w[i].read());
    gpu.optimizer->load(path);
    step_both(a, off, b, [&] { gpu.step(); }, 5, 8);
    EXPECT_EQ(bits(a.weights()), bits(b.weights()));
    gpu.optimizer->save(path);
    OffloadedAdam back(a.groups<AdamGroup>(a.weights()), offload_options(c));
    back.load(path);
    EXPECT_EQ(back.step_count(), 8);
    EXPECT_EQ(bits(back.host_optimizer().exp_avg()), bits(gpu.optimizer->exp_avg()));
  }
  // bf16 weights with a scaler: MixedPrecisionAdam's file, both ways.
  expect_the_mixed_precision_file_moves_both_ways<Adam>(OffloadConfig{DType::bf16, DType::bf16, true}, path);
  std::remove(path.c_str());
}

// Each bucket once per step; a bucket's new gradients must match the old.
TEST(OffloadedAdamGpuArguments, BucketCallsAreChecked) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const Config c{DType::f32, DType::f32, false};
  Model m(c, 5);
  OffloadedAdam off(m.groups<AdamGroup>(m.weights()), offload_options(c));
  EXPECT_EQ(off.num_buckets(), 3);
  expect_error([&] { off.bucket_ready(3); }, ErrorCode::invalid_argument, {"bucket", "is 3", "[0, 3)"});
  off.bucket_ready(0);
  expect_error([&] { off.bucket_ready(0); }, ErrorCode::invalid_argument, {"bucket", "already handed"});
  const std::vector<TensorView> wrong = {m.g[0].view()};  // bucket 1 holds tensors 1 and 2
  expect_error([&] { off.bucket_ready(1, {}, wrong); }, ErrorCode::size_mismatch, {"grads", "expected 2"});
  const std::vector<TensorView> swapped = {m.g[2].view(), m.g[1].view()};
  expect_error([&] { off.bucket_ready(1, {}, swapped); }, ErrorCode::size_mismatch, {"grads[0]", "expected 131073"});
  off.finish();
  EXPECT_EQ(off.step_count(), 1);
  // Real device memory passed as the wrong kind: host memory called cuda:0.
  std::vector<float> host(131073);
  const std::vector<TensorView> on_host = {TensorView{host.data(), 131073, DType::f32, Device::cuda(0)}, m.g[2].view()};
  expect_error([&] { off.bucket_ready(1, {}, on_host); }, ErrorCode::device_mismatch, {"grads[0]", "host memory"});
  // With release: a bucket handed complete takes no more, and every bucket must be handed before finish().
  OffloadedAdam freed(m.groups<AdamGroup>(m.weights()), release_options(c));
  freed.bucket_ready(0, {}, {}, false);
  freed.bucket_ready(0);
  expect_error([&] { freed.bucket_ready(0); }, ErrorCode::invalid_argument, {"bucket", "already handed complete"});
  expect_error([&] { freed.finish(); }, ErrorCode::invalid_argument, {"bucket", "1 was not handed", "release"});
  freed.bucket_ready(1);
  freed.bucket_ready(2);
  freed.finish();
  EXPECT_EQ(freed.step_count(), 1);
  // A parameter in host memory that says cuda:0 is refused at construction.
  std::vector<AdamGroup> groups = m.groups<AdamGroup>(m.weights());
  groups[0].params[0] = TensorView{host.data(), 1000, DType::f32, Device::cuda(0)};
  expect_error([&] { OffloadedAdam(groups, offload_options(c)); }, ErrorCode::device_mismatch, {"params[0]", "host memory"});
}

}  // namespace
}  // namespace gradkit::test
