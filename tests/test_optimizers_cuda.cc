// The owning optimizers' whole step captured in a CUDA graph and replayed:
// the same bits as eager steps, the device step counter advancing on every
// replay, and the learning rate read from device memory at each replay.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/mixed_precision.h"
#include "support/check_cuda.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

struct Params {
  std::vector<TestTensor> w, g;
  explicit Params(uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n : {1000, 65536 * 2 + 1, 3}) {
      w.emplace_back(Device::cuda(0), DType::f32, random_values(rng, n));
      g.emplace_back(Device::cuda(0), DType::f16, random_values(rng, n));
    }
  }
  std::vector<AdamGroup> groups() const {
    AdamGroup group;
    group.hyperparameters.weight_decay = 0.01f;
    for (size_t i = 0; i < w.size(); ++i) {
      group.params.push_back(w[i].view());
      group.grads.push_back(g[i].view());
    }
    return {group};
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& t : w) out.push_back(t.bytes());
    return out;
  }
};

TEST(CudaAdam, WholeStepCapturedInAGraphMatchesEagerSteps) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  Params graphed(1), eager(1);
  Adam a(graphed.groups()), b(eager.groups());
  TestTensor scale(Device::cuda(0), DType::f32, {4.0});
  TestFlag found_inf(Device::cuda(0), false);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  a.step(Stream{stream}, found_inf.pointer(), scale.view().as<float>());
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 5; ++replay) {
    if (replay == 3) {  // a scheduler writes the new lr into device memory between replays
      const float lr = 5e-4f;
      CHECK_CUDA(cudaMemcpyAsync(a.lr_device(), &lr, sizeof lr, cudaMemcpyHostToDevice, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      b.set_lr(0, lr);
    }
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    b.step({}, nullptr, nullptr, 4.0f);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(a.step_count(), 5);
  EXPECT_EQ(graphed.bits(), eager.bits());

  // Loading a state rewrites the hyperparameter table in place: the graph,
  // which holds the table's address, replays with the loaded values.
  const std::string path = ::testing::TempDir() + "gradkit_graph_load_" + std::to_string(::getpid());
  b.save(path);
  a.load(path);
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  b.step({}, nullptr, nullptr, 4.0f);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(graphed.bits(), eager.bits());
  std::remove(path.c_str());

  // found_inf set on the device: a replay changes nothing, the counter included.
  const auto before = graphed.bits();
  CHECK_CUDA(cudaMemsetAsync(found_inf.pointer(), 1, 1, stream));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(graphed.bits(), before);
  EXPECT_EQ(a.step_count(), 6);

  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
}

// The same update on both backends agrees within the f32 tolerance (the
// backends may round differently where the CUDA compiler fuses a multiply-add).
TEST(CudaAdam, AgreesWithTheCpuBackend) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937_64 rng(9);
  const auto w0 = random_values(rng, 50000), g0 = random_values(rng, 50000);
  TestTensor wc(Device::cpu(), DType::f32, w0), gc(Device::cpu(), DType::bf16, g0);
  TestTensor wg(Device::cuda(0), DType::f32, w0), gg(Device::cuda(0), DType::bf16, g0);
  AdamGroup cpu, cuda;
  cpu.params = {wc.view()};
  cpu.grads = {gc.view()};
  cuda.params = {wg.view()};
  cuda.grads = {gg.view()};
  Adam on_cpu({cpu}), on_gpu({cuda});
  for (int s = 0; s < 20; ++s) {
    on_cpu.step();
    on_gpu.step();
  }
  const auto a = wc.read(), b = wg.read();
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(std::abs(a[i]), 1e-3));
  EXPECT_LT(worst, 1e-5);
}

TEST(CudaLamb, WholeStepCapturedInAGraphMatchesEagerSteps) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  Params graphed(2), eager(2);
  auto groups = [](const Params& p) {
    LambGroup g;
    g.hyperparameters.lambda = 0.01f;
    for (size_t i = 0; i < p.w.size(); ++i) {
      g.params.push_back(p.w[i].view());
      g.grads.push_back(p.g[i].view());
    }
    return std::vector<LambGroup>{g};
  };
  Lamb a(groups(graphed), LambOptions{.eta = 0.01f}), b(groups(eager), LambOptions{.eta = 0.01f});
  TestTensor norm(Device::cuda(0), DType::f32, {50.0});
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  a.step(Stream{stream}, {.gradient_norm_device = norm.view().as<float>()});
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 4; ++replay) {
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    b.step({}, {.gradient_norm = 50.0f});
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(a.step_count(), 4);
  EXPECT_EQ(graphed.bits(), eager.bits());
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
}

// The whole mixed-precision step (check, update, scaler) in one graph: the
// replays match eager steps bit for bit, an overflow replay skips and backs
// the scale off, all decided on the device.
TEST(CudaMixedPrecision, WholeStepCapturedInAGraphMatchesEagerSteps) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937_64 rng(5);
  struct Model {
    std::vector<TestTensor> w, g;
  } graphed, eager;
  for (int64_t n : {4096, 65536 + 3}) {
    const auto w0 = random_values(rng, n), g0 = random_values(rng, n, 100.0);
    for (Model* m : {&graphed, &eager}) {
      m->w.emplace_back(Device::cuda(0), DType::f16, w0);
      m->g.emplace_back(Device::cuda(0), DType::f16, g0);
    }
  }
  auto groups = [](const Model& m) {
    AdamGroup g;
    for (size_t i = 0; i < m.w.size(); ++i) {
      g.params.push_back(m.w[i].view());
      g.grads.push_back(m.g[i].view());
    }
    return std::vector<AdamGroup>{g};
  };
  MixedPrecisionOptions options;
  options.max_norm = 1.0f;
  options.scaler.initial_scale = 256.0f;
  options.scaler.growth_interval = 2;
  MixedPrecisionAdam a(groups(graphed), options), b(groups(eager), options);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  a.step(Stream{stream});
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 5; ++replay) {
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    b.step();
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(a.loss_scale(), b.loss_scale());
  EXPECT_EQ(a.loss_scale(), 256.0f * 4);
  for (size_t i = 0; i < graphed.w.size(); ++i) EXPECT_EQ(graphed.w[i].bytes(), eager.w[i].bytes());
  // Poison a gradient on the device: the replay skips, the scale halves.
  const auto before = graphed.w[0].bytes();
  const half inf(INFINITY);
  CHECK_CUDA(cudaMemcpyAsync(graphed.g[1].view().data, &inf, sizeof inf, cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(a.last_step_skipped());
  EXPECT_EQ(a.loss_scale(), 512.0f);
  EXPECT_EQ(graphed.w[0].bytes(), before);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace gradkit::test
