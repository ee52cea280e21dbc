// The sharded Muon step with every part and exchange on one CUDA stream of
// the caller's, as gradkit.torch and muon_sharded_step run it over NCCL: the
// exchanges here are device copies on that stream (one rank, whose rows and
// matrices are all its own), so nothing waits for the device but the
// stream itself. The products of orthogonalize_beside run on the plan's side
// streams; join must hold the stream until they are done, or the copy back
// and the update after it read the owner buffer before the products wrote
// it. The matrices are large enough (about 0.3 ms of products a bucket on
// an H100) that a join that waited for nothing would lose that race. The
// reference: the same step with the products on the stream (orthogonalize),
// which the plan computes with the same launches, so bit for bit.
//
// GRADKIT_TEST_LEAVE_OUT_JOIN=1 leaves the joins out: a check by hand that
// this test sees the race (it must then fail; bench/RESULTS.md, 2026-11-27).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gradkit/ops/muon_sharded.h"
#include "support/check_cuda.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

// Two shape classes, so two buckets: 8 square matrices of 1024, then 4 of
// 1024 x 3072.
const std::vector<MatrixShape> kShapes = {{8, 1024, 1024}, {4, 1024, 3072}};

struct OneRank {
  std::vector<TestTensor> w, g, buf;
  std::vector<TensorView> wv, gv, bv;
  std::vector<int64_t> splits;
  MuonShardedPlan plan;

  explicit OneRank(uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (const MatrixShape& s : kShapes) {
      const int64_t n = s.batch * s.rows * s.cols;
      w.emplace_back(Device::cuda(0), DType::f32, random_values(rng, n));
      g.emplace_back(Device::cuda(0), DType::f32, random_values(rng, n));
      buf.emplace_back(Device::cuda(0), DType::f32, random_values(rng, n, 0.1));
      splits.insert(splits.end(), {0, s.batch * s.rows});
    }
    for (auto& t : w) wv.push_back(t.view());
    for (auto& t : g) gv.push_back(t.view());
    for (auto& t : buf) bv.push_back(t.view());
    MuonPlanOptions options;
    options.buckets = 2;
    const MuonHyperparameters h;
    plan = MuonShardedPlan({wv, gv, bv, kShapes, splits, 0, 1}, std::span(&h, 1), {}, options);
  }
};

// One rank's all-to-all of a bucket: its one section, a device copy on the stream.
void exchange(const MuonShardedPlan& plan, size_t k, bool back, cudaStream_t stream) {
  const TensorView from = back ? plan.owner_buffer(k) : plan.shard_buffer(k);
  const TensorView to = back ? plan.shard_buffer(k) : plan.owner_buffer(k);
  ASSERT_EQ(from.numel, to.numel);
  CHECK_CUDA(cudaMemcpyAsync(to.data, from.data, static_cast<size_t>(from.numel) * 2, cudaMemcpyDeviceToDevice, stream));
}

// The step in gradkit.torch's order: each bucket's momentum, exchange and
// products (beside the stream, or on it), then each bucket joined, sent
// back and updated.
void step(const OneRank& r, bool beside, bool join, cudaStream_t stream) {
  const Stream s{stream};
  const size_t buckets = r.plan.num_buckets();
  for (size_t k = 0; k < buckets; ++k) {
    r.plan.momentum(k, {}, s);
    exchange(r.plan, k, false, stream);
    if (beside) r.plan.orthogonalize_beside(k, {}, s);
    else r.plan.orthogonalize(k, {}, s);
  }
  for (size_t k = 0; k < buckets; ++k) {
    if (beside && join) r.plan.join(k, s);
    exchange(r.plan, k, true, stream);
    r.plan.update(k, {}, s);
  }
}

TEST(MuonShardedStreams, JoinHoldsTheStreamUntilTheProductsBesideItAreDone) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const char* leave_out = std::getenv("GRADKIT_TEST_LEAVE_OUT_JOIN");
  const bool join = leave_out == nullptr || std::string(leave_out) != "1";
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  OneRank on_stream(5), beside(5);
  ASSERT_EQ(beside.plan.num_buckets(), 2u);
  for (int i = 0; i < 3; ++i) {
    step(on_stream, false, true, stream);
    step(beside, true, join, stream);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaStreamDestroy(stream));
  for (size_t i = 0; i < kShapes.size(); ++i) {
    EXPECT_EQ(beside.w[i].bytes(), on_stream.w[i].bytes()) << "weights of tensor " << i << (join ? "" : " (joins left out)");
    EXPECT_EQ(beside.buf[i].bytes(), on_stream.buf[i].bytes()) << "momentum of tensor " << i;
  }
}

}  // namespace
}  // namespace gradkit::test
