// What only the CUDA backend has to show: results bitwise equal to the CPU
// backend, launches on a plan captured in a CUDA graph and replayed, work
// ordered on a user's stream.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "gradkit/ops/gradient.h"
#include "support/check_cuda.h"
#include "support/reference.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

class CudaGradient : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
};

// Both backends compute in f32 and round once to nearest even, so they agree
// to the bit on every pair (NaN payloads aside; the inputs here are finite).
TEST_F(CudaGradient, BitwiseEqualToCpuOnEveryPair) {
  std::mt19937_64 rng(21);
  for (DTypePair pair : accumulate_dtype_pairs()) {
    for (int64_t n : {1, 31, 65536 * 2 + 3}) {
      const auto b0 = random_values(rng, n);
      const auto v0 = random_values(rng, n, 3.0);
      TestTensor bc(Device::cpu(), pair.first, b0), vc(Device::cpu(), pair.second, v0);
      TestTensor bg(Device::cuda(0), pair.first, b0), vg(Device::cuda(0), pair.second, v0);
      accumulate(bc.view(), vc.view());
      accumulate(bg.view(), vg.view());
      synchronize(Device::cuda(0));
      EXPECT_EQ(bc.bytes(), bg.bytes()) << dtype_name(pair.first) << "/" << dtype_name(pair.second) << " n=" << n;
      accumulate_v2(bc.view(), vc.view(), Flag::host(true));
      accumulate_v2(bg.view(), vg.view(), Flag::host(true));
      synchronize(Device::cuda(0));
      EXPECT_EQ(bc.bytes(), bg.bytes()) << "overwrite";
    }
  }
}

// A plan launched inside stream capture; the graph replayed k times adds k
// times, with do_update read from device memory at each replay.
TEST_F(CudaGradient, PlanLaunchesAreCapturableInAGraph) {
  std::mt19937_64 rng(22);
  std::vector<TestTensor> buffers, values;
  std::vector<std::vector<double>> b0, v0;
  for (int i = 0; i < 300; ++i) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 3000);
    b0.push_back(round_to(DType::f32, random_values(rng, n)));
    v0.push_back(round_to(DType::bf16, random_values(rng, n)));
    buffers.emplace_back(Device::cuda(0), DType::f32, b0.back());
    values.emplace_back(Device::cuda(0), DType::bf16, v0.back());
  }
  std::vector<TensorView> bv, vv;
  for (int i = 0; i < 300; ++i) bv.push_back(buffers[i].view()), vv.push_back(values[i].view());
  const AccumulatePlan plan(bv, vv);
  TestFlag do_update(Device::cuda(0), true);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  plan.accumulate(Flag::device(do_update.pointer()), Stream{stream});
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));

  for (int i = 0; i < 300; ++i) {
    std::vector<double> want = b0[i];
    for (int k = 0; k < 3; ++k) want = round_to(DType::f32, reference_accumulate(want, v0[i], false));
    const auto got = buffers[i].read();
    for (size_t j = 0; j < got.size(); ++j) {
      ASSERT_TRUE(within(got[j], want[j], elementwise_tolerance(DType::f32))) << i << "," << j;
    }
  }
  // The flag turned off on the device: a replay changes nothing.
  const auto before = buffers[7].bytes();
  CHECK_CUDA(cudaMemsetAsync(do_update.pointer(), 0, 1, stream));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(buffers[7].bytes(), before);

  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
}

TEST_F(CudaGradient, ZeroPlanOnAStream) {
  std::mt19937_64 rng(23);
  TestTensor a(Device::cuda(0), DType::bf16, random_values(rng, 100003));
  TestTensor b(Device::cuda(0), DType::f64, random_values(rng, 77));
  const TensorView list[] = {a.view()};
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  ZeroPlan(list).run(Stream{stream});
  zero(b.view(), Stream{stream});
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (uint8_t byte : a.bytes()) ASSERT_EQ(byte, 0);
  for (uint8_t byte : b.bytes()) ASSERT_EQ(byte, 0);
  CHECK_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace gradkit::test

namespace gradkit::test {
namespace {

// Set-up copies (tensor data, plan tables) must have landed before a kernel
// on a non-blocking stream reads them: fresh memory and a fresh plan,
// launched at once, many times.
TEST(CudaSetUp, FreshPlansAreReadyForNonBlockingStreams) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::mt19937_64 rng(24);
  for (int round = 0; round < 30; ++round) {
    const auto b0 = round_to(DType::f32, random_values(rng, 300000));
    const auto v0 = round_to(DType::f32, random_values(rng, 300000));
    TestTensor buffer(Device::cuda(0), DType::f32, b0), value(Device::cuda(0), DType::f32, v0);
    const TensorView bv[] = {buffer.view()}, vv[] = {value.view()};
    AccumulatePlan(bv, vv).accumulate(Flag::none(), Stream{stream});
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto got = buffer.read();
    const auto want = reference_accumulate(b0, v0, false);
    for (size_t i = 0; i < got.size(); i += 997) ASSERT_TRUE(within(got[i], want[i], elementwise_tolerance(DType::f32))) << round;
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace gradkit::test
