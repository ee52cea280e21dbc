// muon_sharded_step over a communicator, under mpiexec: each rank holds
// torch.chunk's rows of a seeded model (every rank can make the whole
// model), steps them with MuonShardedPlan and the communicator's
// all-to-alls, and compares its rows with the unsharded MuonPlan's step of
// the whole model, run on every rank: bit for bit with MPI (CPU plans);
// with NCCL (CUDA plans) the momentum bit for bit and the update within
// the products' tolerance. Also the refusal of a communicator that is not
// the plan's.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "comm/comm_test_support.h"
#include "gradkit/ops/muon_sharded.h"
#include "gradkit/optim/muon_sharded_step.h"
#include "support/muon_shards.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

std::vector<double> minus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

using MuonShardedStep = OnEachBackend;

// Three steps of a plan of `buckets` buckets against the unsharded plan.
void expect_unsharded_steps(Communicator& c, int32_t buckets) {
  const Device device = c.device();
  const int ranks = c.size(), me = c.rank();
  // Rows that split unevenly, a stack of 3 experts (on 4 ranks one holds none), tall and wide.
  const std::vector<MatrixShape> shapes = {{1, 24, 40}, {1, 40, 24}, {1, 7, 33}, {3, 16, 24}, {1, 24, 40}};
  MuonHyperparameters h;
  h.lr = 0.02;
  std::mt19937_64 rng(70);  // the same on every rank
  std::vector<TestTensor> w, g, buf, whole_w, whole_g, whole_buf;
  std::vector<TensorView> wv, gv, bv, whole_wv, whole_gv, whole_bv;
  std::vector<int64_t> splits;
  std::vector<std::vector<double>> start;
  for (const MatrixShape& s : shapes) {
    const int64_t n = s.batch * s.rows * s.cols;
    const auto split = s.batch == 1 ? chunk_splits(s.rows, 1, ranks) : chunk_splits(s.batch, s.rows, ranks);
    splits.insert(splits.end(), split.begin(), split.end());
    const auto weights = random_values(rng, n), momentum = round_to(DType::f32, random_values(rng, n, 0.1));
    start.push_back(weights);
    const int64_t lo = split[static_cast<size_t>(me)], hi = split[static_cast<size_t>(me) + 1];
    w.emplace_back(device, DType::f32, rows_of(weights, s.cols, lo, hi));
    g.emplace_back(device, DType::f32, std::vector<double>(static_cast<size_t>((hi - lo) * s.cols), 1.0));
    buf.emplace_back(device, DType::f32, rows_of(momentum, s.cols, lo, hi));
    whole_w.emplace_back(device, DType::f32, weights);
    whole_g.emplace_back(device, DType::f32, std::vector<double>(static_cast<size_t>(n), 1.0));
    whole_buf.emplace_back(device, DType::f32, momentum);
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    wv.push_back(w[i].view()), gv.push_back(g[i].view()), bv.push_back(buf[i].view());
    whole_wv.push_back(whole_w[i].view()), whole_gv.push_back(whole_g[i].view()), whole_bv.push_back(whole_buf[i].view());
  }
  MuonPlanOptions options;
  options.buckets = buckets;
  const MuonShardedPlan plan({wv, gv, bv, shapes, splits, me, ranks}, std::span(&h, 1), {}, options);
  const MuonPlan whole({whole_wv, whole_gv, whole_bv, shapes}, std::span(&h, 1));
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const MatrixShape& s = shapes[i];
      const auto grads = random_values(rng, s.batch * s.rows * s.cols);
      const size_t at = i * static_cast<size_t>(ranks + 1) + static_cast<size_t>(me);
      overwrite(g[i], rows_of(grads, s.cols, splits[at], splits[at + 1]));
      overwrite(whole_g[i], grads);
    }
    muon_sharded_step(plan, c, {});
    whole.step();
  }
  c.wait();
  for (size_t i = 0; i < shapes.size(); ++i) {
    const size_t at = i * static_cast<size_t>(ranks + 1) + static_cast<size_t>(me);
    const int64_t cols = shapes[i].cols, lo = splits[at], hi = splits[at + 1];
    const std::string what = "rank " + std::to_string(me) + " tensor " + std::to_string(i) + ", " +
                             std::to_string(plan.num_buckets()) + " buckets";
    EXPECT_EQ(buf[i].read(), rows_of(whole_buf[i].read(), cols, lo, hi)) << what << " momentum";
    const auto got = w[i].read(), want = rows_of(whole_w[i].read(), cols, lo, hi);
    if (device.is_cuda()) {
      const auto before = rows_of(start[i], cols, lo, hi);
      if (!got.empty()) {
        EXPECT_LE(relative_error(minus(got, before), minus(want, before)), muon_update_tolerance(false)) << what;
      }
    } else {
      EXPECT_EQ(got, want) << what << " weights";
    }
  }
}

// One bucket, and three (the shapes make four classes): an exchange per bucket.
TEST_P(MuonShardedStep, MatchesTheUnshardedStepOnEveryRank) {
  for (const int32_t buckets : {1, 3}) expect_unsharded_steps(comm(), buckets);
}

TEST_P(MuonShardedStep, RefusesAnotherRanksCommunicator) {
  Communicator& c = comm();
  const Device device = c.device();
  const std::vector<MatrixShape> shapes = {{1, 8, 8}};
  std::mt19937_64 rng(71);
  const TestTensor w(device, DType::f32, random_values(rng, 64)), g(device, DType::f32, random_values(rng, 64)),
      buf(device, DType::f32, random_values(rng, 64));
  const std::vector<TensorView> wv = {w.view()}, gv = {g.view()}, bv = {buf.view()};
  const std::vector<int64_t> splits = {0, 8};  // a plan of one rank
  const MuonHyperparameters h;
  const MuonShardedPlan plan({wv, gv, bv, shapes, splits, 0, 1}, std::span(&h, 1));
  const auto before = w.bytes();
  expect_error([&] { muon_sharded_step(plan, c, {}); }, ErrorCode::invalid_argument, {"comm", "the plan's rank 0 of 1"});
  EXPECT_EQ(w.bytes(), before);
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(MuonShardedStep);

}  // namespace
}  // namespace gradkit::test
