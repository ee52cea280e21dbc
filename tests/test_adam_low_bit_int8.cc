// adam_step with 8-bit blockwise moments on every backend: bad arguments,
// the owning Adam's state file; and the f32-moment path's CPU and CUDA
// backends bit for bit. What the 8- and 4-bit forms share (one step against
// the float64 reference, many steps, NaN, found_inf, determinism, CPU =
// CUDA) is tested for both in test_adam_low_bit.cc.
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
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/master.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/state_file.h"
#include "support/adam_config.h"
#include "support/adam_reference.h"
#include "support/low_bit_adam.h"
#include "support/low_bit_reference.h"
#include "support/device_param.h"
#include "support/low_bit_checks.h"
#include "support/expect_error.h"
#include "support/state_file_bytes.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

using Config = AdamConfig;

std::vector<Config> configs() { return low_bit_configs(); }

const std::vector<int64_t> kSizes = {1, 255, 256 + 7, 65536 + 300, 1000};

// Everything one 8-bit step reads and writes, on one device.
struct Tensors : LowBitTensors {
  Tensors(Device device, const Config& c, uint64_t seed) : LowBitTensors(device, c, seed, 8, kSizes, 4, 4) {}
};

using AdamInt8 = OnEachDevice;

TEST_P(AdamInt8, RejectsBadArgumentsNamingThem) {
  const Config c = configs()[0];
  Tensors t(device(), c, 6);
  const auto before = t.bytes();
  AdamTensors x = t.tensors(c);
  const AdamHyperparameters h;
  auto plan = [&](const AdamTensors& tensors, AdamHyperparameters hyper = {}) { AdamPlan(tensors, std::span(&hyper, 1)); };

  AdamTensors missing = x;
  missing.exp_avg_sq_absmax = {};
  expect_error([&] { plan(missing); }, ErrorCode::size_mismatch, {"exp_avg_sq_absmax", "exp_avg is u8"});

  AdamHyperparameters ams;
  ams.amsgrad = true;
  AdamTensors with_max = x;
  with_max.max_exp_avg_sq = x.exp_avg_sq;
  expect_error([&] { plan(with_max, ams); }, ErrorCode::invalid_argument, {"hyperparameters[0].amsgrad", "8-bit"});

  std::vector<TensorView> wrong_blocks = t.amv;
  wrong_blocks[2].numel += 1;
  AdamTensors blocks = x;
  blocks.exp_avg_absmax = wrong_blocks;
  expect_error([&] { plan(blocks); }, ErrorCode::size_mismatch, {"exp_avg_absmax[2]", "expected 2"});

  std::vector<TestTensor> f32_v;
  for (int64_t n : kSizes) f32_v.emplace_back(device(), DType::f32, std::vector<double>(n, 0.0));
  const auto f32_views = views(f32_v);
  AdamTensors mixed = x;
  mixed.exp_avg_sq = f32_views;
  expect_error([&] { plan(mixed); }, ErrorCode::dtype_unsupported, {"exp_avg_sq", "u8"});

  AdamTensors absmax_without_codes = x;
  absmax_without_codes.exp_avg = f32_views;
  absmax_without_codes.exp_avg_sq = f32_views;
  expect_error([&] { plan(absmax_without_codes); }, ErrorCode::invalid_argument, {"exp_avg_absmax", "not u8"});

  AdamTensors u8_grads = x;
  u8_grads.grads = t.mv;
  expect_error([&] { plan(u8_grads); }, ErrorCode::dtype_unsupported, {"grads[0]", "u8"});
  (void)h;
  EXPECT_EQ(t.bytes(), before);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(AdamInt8);

// The owning Adam with 8-bit moments (support/low_bit_checks.h).
AdamGroup owning_group() {
  AdamGroup group;
  group.hyperparameters.lr = 1e-2f;
  group.hyperparameters.weight_decay = 0.01f;
  return group;
}

using AdamInt8Optimizer = OnEachDevice;

TEST_P(AdamInt8Optimizer, ResumeFromACheckpointEqualsTheStraightRun) {
  expect_resumed_run_equals_straight_run<Adam>(device(), owning_group(), {.moment_dtype = DType::u8});
}

// A file written before 8-bit moments (format version 1) still loads.
TEST_P(AdamInt8Optimizer, AVersion1FileStillLoads) {
  OwningModel model(device(), 8);
  Adam adam(model.groups(owning_group()));
  std::mt19937_64 rng(1);
  model.new_gradients(rng);
  adam.step();
  const std::string path = ::testing::TempDir() + "gradkit_adam_v1_" + std::to_string(::getpid());
  adam.save(path);
  write_raw_state_file(path, read_raw_sections(path), 1);
  Adam second(model.groups(owning_group()));
  second.load(path);
  EXPECT_EQ(second.step_count(), 1);
  EXPECT_EQ(moment_state(second), moment_state(adam));
  std::remove(path.c_str());
}

TEST_P(AdamInt8Optimizer, RejectsWhatCannotWork) {
  OwningModel model(device(), 9);
  auto groups = model.groups(owning_group());
  groups[0].hyperparameters.amsgrad = true;
  expect_error([&] { Adam(groups, {.moment_dtype = DType::u8}); }, ErrorCode::invalid_argument,
               {"hyperparameters[0].amsgrad", "8-bit"});
  expect_error([&] { Adam(model.groups(owning_group()), {.moment_dtype = DType::i16}); }, ErrorCode::dtype_unsupported,
               {"options.moment_dtype", "f32, bf16 or u8"});
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(AdamInt8Optimizer);

// The f32-moment path's CPU and CUDA backends give the same bytes.
TEST(AdamBackends, F32MomentsCpuAndCudaAgreeBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  for (DType weights : {DType::f32, DType::bf16}) {
    std::vector<std::vector<uint8_t>> results;
    for (Device device : {Device::cpu(), Device::cuda(0)}) {
      std::mt19937_64 rng(8);
      const int64_t n = 65536 * 2 + 5;
      const std::vector<double> master = round_to(DType::f32, random_values(rng, n));
      TestTensor w(device, weights, master), rem(device, DType::i16, std::vector<double>(n, 0.0));
      if (weights == DType::bf16) {
        const TestTensor f32(device, DType::f32, master);
        split_masters(f32.view(), w.view(), rem.view());
      }
      TestTensor g(device, DType::bf16, random_values(rng, n)), m(device, DType::f32, std::vector<double>(n, 0.0)),
          v(device, DType::f32, std::vector<double>(n, 0.0));
      const TensorView W[] = {w.view()}, G[] = {g.view()}, M[] = {m.view()}, V[] = {v.view()}, R[] = {rem.view()};
      AdamTensors t{W, G, M, V, {}, {}};
      if (weights == DType::bf16) t.weight_remainder = R;
      AdamHyperparameters h;
      h.weight_decay = 0.1f;
      const AdamPlan plan(t, std::span(&h, 1));
      for (int step = 1; step <= 10; ++step) plan.step({.step = step});
      synchronize(device);
      results.push_back(w.bytes());
      results.push_back(m.bytes());
      results.push_back(v.bytes());
    }
    EXPECT_EQ(std::vector(results.begin(), results.begin() + 3), std::vector(results.begin() + 3, results.end()))
        << dtype_name(weights) << " weights";
  }
}

}  // namespace
}  // namespace gradkit::test
