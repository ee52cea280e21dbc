// MuonShardedPlan on every backend: ranks simulated in one process (each
// with its own rows and plan; the all-to-alls are copies between their
// exchange buffers, as an all-to-all delivers them) against the unsharded
// MuonPlan on the whole tensors: bit for bit on the CPU, where both run
// each matrix's products alone; on CUDA the momentum bit for bit and the
// update within the products' tolerance (a batch of the owner's matrices
// may be tiled otherwise than the whole batch). Plus the owners' balance,
// found_inf, grad_scale, set_grads and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/muon_sharded.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/muon_shards.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

struct Dtypes {
  DType param = DType::f32, grad = DType::f32, momentum = DType::f32;
};

// The whole tensors' starting values and each step's gradients.
struct Model {
  std::vector<MatrixShape> shapes;
  std::vector<std::vector<int64_t>> splits;  // per tensor, ranks + 1
  std::vector<std::vector<double>> w, buf;
  Dtypes d;

  int64_t numel(size_t i) const { return shapes[i].batch * shapes[i].rows * shapes[i].cols; }
  std::vector<std::vector<double>> gradients(std::mt19937_64& rng, double scale = 1.0) const {
    std::vector<std::vector<double>> out;
    for (size_t i = 0; i < shapes.size(); ++i) out.push_back(round_to(d.grad, random_values(rng, numel(i), scale)));
    return out;
  }
};

Model make_model(std::mt19937_64& rng, const std::vector<MatrixShape>& shapes, int ranks, Dtypes d = {}) {
  Model m{shapes, {}, {}, {}, d};
  for (size_t i = 0; i < shapes.size(); ++i) {
    const MatrixShape& s = shapes[i];
    m.splits.push_back(s.batch == 1 ? chunk_splits(s.rows, 1, ranks) : chunk_splits(s.batch, s.rows, ranks));
    m.w.push_back(round_to(d.param, random_values(rng, m.numel(i))));
    m.buf.push_back(round_to(d.momentum, random_values(rng, m.numel(i), 0.1)));
  }
  return m;
}

// One rank: its rows of every tensor and its plan.
struct Rank {
  std::vector<TestTensor> w, g, buf;
  std::vector<TensorView> wv, gv, bv;
  std::vector<int64_t> splits;
  MuonShardedPlan plan;

  Rank(Device device, const Model& m, int rank, int ranks, std::span<const MuonHyperparameters> h,
       std::span<const int32_t> groups, MuonPlanOptions options = {}) {
    for (size_t i = 0; i < m.shapes.size(); ++i) {
      const int64_t lo = m.splits[i][static_cast<size_t>(rank)], hi = m.splits[i][static_cast<size_t>(rank) + 1];
      const int64_t cols = m.shapes[i].cols;
      w.emplace_back(device, m.d.param, rows_of(m.w[i], cols, lo, hi));
      g.emplace_back(device, m.d.grad, std::vector<double>(static_cast<size_t>((hi - lo) * cols), 1.0));
      buf.emplace_back(device, m.d.momentum, rows_of(m.buf[i], cols, lo, hi));
      splits.insert(splits.end(), m.splits[i].begin(), m.splits[i].end());
    }
    for (auto& t : w) wv.push_back(t.view());
    for (auto& t : g) gv.push_back(t.view());
    for (auto& t : buf) bv.push_back(t.view());
    plan = MuonShardedPlan({wv, gv, bv, m.shapes, splits, rank, ranks}, h, groups, options);
  }

  void set_gradients(const Model& m, int rank, const std::vector<std::vector<double>>& grads) {
    for (size_t i = 0; i < g.size(); ++i) {
      const int64_t lo = m.splits[i][static_cast<size_t>(rank)], hi = m.splits[i][static_cast<size_t>(rank) + 1];
      overwrite(g[i], rows_of(grads[i], m.shapes[i].cols, lo, hi));
    }
  }
};

// Bucket by bucket: every bucket's momentum and exchange, then each one
// orthogonalised and sent back, then each one's update; `beside`: in the
// order gradkit.torch overlaps them, every bucket's products started beside
// the stream, then each one joined and sent back.
void bucketed_step(std::vector<Rank>& ranks, bool beside, const MuonStepInputs& in = {}) {
  const size_t buckets = ranks[0].plan.num_buckets();
  for (size_t k = 0; k < buckets; ++k) {
    for (Rank& r : ranks) r.plan.momentum(k, in, {});
    all_to_all(ranks, k, false);
  }
  for (size_t k = 0; k < buckets; ++k) {
    for (Rank& r : ranks) {
      if (beside) r.plan.orthogonalize_beside(k, in);
      else r.plan.orthogonalize(k, in, {});
    }
    if (!beside) all_to_all(ranks, k, true);
  }
  for (size_t k = 0; beside && k < buckets; ++k) {
    for (Rank& r : ranks) r.plan.join(k);
    all_to_all(ranks, k, true);
  }
  for (size_t k = 0; k < buckets; ++k) {
    for (Rank& r : ranks) r.plan.update(k, in, {});
  }
}

// The unsharded plan's tensors, from the same model.
struct Whole {
  std::vector<TestTensor> w, g, buf;
  std::vector<TensorView> wv, gv, bv;
  MuonPlan plan;
  Whole(Device device, const Model& m, std::span<const MuonHyperparameters> h, std::span<const int32_t> groups) {
    for (size_t i = 0; i < m.shapes.size(); ++i) {
      w.emplace_back(device, m.d.param, m.w[i]);
      g.emplace_back(device, m.d.grad, std::vector<double>(static_cast<size_t>(m.numel(i)), 1.0));
      buf.emplace_back(device, m.d.momentum, m.buf[i]);
    }
    for (auto& t : w) wv.push_back(t.view());
    for (auto& t : g) gv.push_back(t.view());
    for (auto& t : buf) bv.push_back(t.view());
    plan = MuonPlan({wv, gv, bv, m.shapes}, h, groups);
  }
  void set_gradients(const Model& m, const std::vector<std::vector<double>>& grads) {
    for (size_t i = 0; i < g.size(); ++i) overwrite(g[i], grads[i]);
  }
};

std::vector<Rank> make_ranks(Device device, const Model& m, int n, std::span<const MuonHyperparameters> h,
                             std::span<const int32_t> groups = {}, MuonPlanOptions options = {}) {
  std::vector<Rank> ranks;
  ranks.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) ranks.emplace_back(device, m, r, n, h, groups, options);
  return ranks;
}

// The ranks' rows of tensor i put together.
std::vector<double> gathered(const std::vector<Rank>& ranks, size_t i, bool momentum) {
  std::vector<double> out;
  for (const Rank& r : ranks) {
    const auto part = (momentum ? r.buf : r.w)[i].read();
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

std::vector<double> minus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

// After the same steps, the sharded weights and momentum against the
// whole plan's (see the file's comment for what "the same" means on each).
void expect_same(Device device, const std::vector<Rank>& ranks, const Whole& whole, const Model& m,
                 const std::string& what) {
  for (size_t i = 0; i < m.shapes.size(); ++i) {
    const auto w = gathered(ranks, i, false), buf = gathered(ranks, i, true);
    const std::string where = what + " tensor " + std::to_string(i);
    EXPECT_EQ(buf, whole.buf[i].read()) << where << " momentum";
    if (device.is_cuda() && m.d.param == DType::f32) {
      EXPECT_LE(relative_error(minus(w, m.w[i]), minus(whole.w[i].read(), m.w[i])), muon_update_tolerance(false))
          << where << " update";
    } else if (device.is_cuda()) {
      EXPECT_LE(relative_error(w, whole.w[i].read()), optimizer_tolerance(m.d.param, 3)) << where;
    } else {
      EXPECT_EQ(w, whole.w[i].read()) << where << " weights";
    }
  }
}

using MuonSharded = OnEachDevice;

struct Case {
  std::string name;
  std::vector<MatrixShape> shapes;
  int ranks;
  Dtypes d;
  std::vector<MuonHyperparameters> h;
  std::vector<int32_t> groups;
};

std::vector<Case> cases() {
  MuonHyperparameters fast;
  fast.lr = 0.02;
  MuonHyperparameters other = fast;
  other.nesterov = false;
  other.momentum = 0.9;
  other.adjust_lr = MuonLrAdjust::match_rms_adamw;
  other.ns_steps = 4;
  const std::vector<MatrixShape> mixed = {{1, 24, 40}, {1, 40, 24}, {1, 7, 33}, {3, 16, 24}, {1, 24, 40}, {1, 3, 20}};
  // The recipe's parts the sharded plan takes: Polar Express, MuonEq on the
  // owners' whole matrices, cautious weight decay on the rows.
  MuonHyperparameters recipe = fast;
  recipe.set_ns_coefficients(kPolarExpressCoefficients);
  recipe.divisor = MuonDivisor::polar_express;
  recipe.eps = 1e-6f;
  recipe.equilibrate_rows = true;
  recipe.cautious_weight_decay = true;
  return {
      {"recipe_three_ranks", mixed, 3, {}, {recipe}, {}},
      {"one_rank", mixed, 1, {}, {fast}, {}},
      {"two_ranks", mixed, 2, {}, {fast}, {}},
      {"three_ranks_uneven", mixed, 3, {}, {fast}, {}},
      {"four_ranks_some_empty", mixed, 4, {}, {fast}, {}},
      {"two_groups", mixed, 2, {}, {fast, other}, {0, 1, 1, 0, 1, 0}},
      {"bf16_everything", {{1, 24, 40}, {2, 40, 24}}, 2, {DType::bf16, DType::bf16, DType::bf16}, {fast}, {}},
      {"f16_grads_bf16_momentum", {{1, 24, 40}, {1, 40, 24}}, 3, {DType::f32, DType::f16, DType::bf16}, {fast}, {}},
  };
}

// Three steps, sharded over 1 to 4 ranks, against the whole plan.
TEST_P(MuonSharded, MatchesTheUnshardedStep) {
  uint64_t seed = 40;
  for (const Case& c : cases()) {
    std::mt19937_64 rng(seed++);
    const Model m = make_model(rng, c.shapes, c.ranks, c.d);
    std::vector<Rank> ranks = make_ranks(device(), m, c.ranks, c.h, c.groups);
    Whole whole(device(), m, c.h, c.groups);
    for (int step = 1; step <= 3; ++step) {
      const auto grads = m.gradients(rng);
      for (int r = 0; r < c.ranks; ++r) ranks[static_cast<size_t>(r)].set_gradients(m, r, grads);
      whole.set_gradients(m, grads);
      sharded_step(ranks);
      whole.plan.step();
    }
    expect_same(device(), ranks, whole, m, c.name);
  }
}

// Splits that are not torch.chunk's: a 3-D stack cut inside its matrices,
// and a rank that holds no row of anything.
TEST_P(MuonSharded, AnySplitOfTheRows) {
  std::mt19937_64 rng(50);
  Model m = make_model(rng, {{3, 8, 24}, {1, 24, 16}}, 3);
  m.splits = {{0, 5, 5, 24}, {0, 0, 0, 24}};
  const MuonHyperparameters h;
  std::vector<Rank> ranks = make_ranks(device(), m, 3, std::span(&h, 1));
  Whole whole(device(), m, std::span(&h, 1), {});
  for (int step = 0; step < 2; ++step) {
    const auto grads = m.gradients(rng);
    for (int r = 0; r < 3; ++r) ranks[static_cast<size_t>(r)].set_gradients(m, r, grads);
    whole.set_gradients(m, grads);
    sharded_step(ranks);
    whole.plan.step();
  }
  expect_same(device(), ranks, whole, m, "cut stack");
}

// Owners by Newton-Schulz FLOPs, largest first: four equal matrices and one
// large one over two ranks put the large one alone... and the same owners on
// every rank.
TEST_P(MuonSharded, OwnersBalanceTheProducts) {
  std::mt19937_64 rng(51);
  const Model m = make_model(rng, {{4, 32, 32}, {1, 64, 64}, {1, 32, 32}, {1, 32, 32}}, 2);
  const MuonHyperparameters h;
  std::vector<Rank> ranks = make_ranks(device(), m, 2, std::span(&h, 1));
  // 64x64 costs 8 of the 32x32's: rank 0 takes it, rank 1 the six small ones (6 < 8).
  EXPECT_EQ(ranks[0].plan.owner(1, 0), 0);
  for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(ranks[0].plan.owner(0, k), 1) << k;
  EXPECT_EQ(ranks[0].plan.owned_flops(), 6.0 * 64 * 64 * 64);
  EXPECT_EQ(ranks[1].plan.owned_flops(), 6.0 * 6 * 32 * 32 * 32);
  for (size_t i = 0; i < m.shapes.size(); ++i)
    for (int64_t k = 0; k < m.shapes[i].batch; ++k) EXPECT_EQ(ranks[0].plan.owner(i, k), ranks[1].plan.owner(i, k));
  EXPECT_EQ(ranks[0].plan.num_owned_batches(), 1u);
  EXPECT_EQ(ranks[1].plan.num_owned_batches(), 1u);  // the six 32x32 in one batch
  expect_error([&] { (void)ranks[0].plan.owner(4, 0); }, ErrorCode::invalid_argument, {"tensor, matrix"});
}

// found_inf (on every rank, as a gradient check all-reduced gives it)
// writes nothing in any part; grad_scale divides the gradients as the whole
// plan's does.
TEST_P(MuonSharded, FoundInfAndGradScale) {
  std::mt19937_64 rng(52);
  const Model m = make_model(rng, {{1, 24, 40}, {2, 16, 24}}, 2);
  const MuonHyperparameters h;
  std::vector<Rank> ranks = make_ranks(device(), m, 2, std::span(&h, 1));
  Whole whole(device(), m, std::span(&h, 1), {});
  const auto grads = m.gradients(rng, 256.0);
  for (int r = 0; r < 2; ++r) ranks[static_cast<size_t>(r)].set_gradients(m, r, grads);
  whole.set_gradients(m, grads);
  const TestFlag found(device(), true), clear(device(), false);
  sharded_step(ranks, {found.pointer()});
  for (size_t i = 0; i < m.shapes.size(); ++i) {
    EXPECT_EQ(gathered(ranks, i, false), m.w[i]) << i;
    EXPECT_EQ(gathered(ranks, i, true), m.buf[i]) << i;
  }
  const TestTensor scale(device(), DType::f32, {256.0});
  MuonStepInputs in{clear.pointer()};
  in.grad_scale_device = scale.view().as<float>();
  sharded_step(ranks, in);
  whole.plan.step({nullptr, 256.0f});
  expect_same(device(), ranks, whole, m, "grad_scale");
}

TEST_P(MuonSharded, SetGradsRepointsTheRows) {
  std::mt19937_64 rng(53);
  const Model m = make_model(rng, {{1, 24, 40}, {3, 16, 24}}, 2);
  const MuonHyperparameters h;
  std::vector<Rank> ranks = make_ranks(device(), m, 2, std::span(&h, 1));
  Whole whole(device(), m, std::span(&h, 1), {});
  const auto grads = m.gradients(rng);
  whole.set_gradients(m, grads);
  std::vector<std::vector<TestTensor>> fresh(2);
  for (int r = 0; r < 2; ++r) {
    std::vector<TensorView> views;
    for (size_t i = 0; i < m.shapes.size(); ++i) {
      const int64_t lo = m.splits[i][static_cast<size_t>(r)], hi = m.splits[i][static_cast<size_t>(r) + 1];
      fresh[static_cast<size_t>(r)].emplace_back(device(), DType::f32, rows_of(grads[i], m.shapes[i].cols, lo, hi));
    }
    for (auto& t : fresh[static_cast<size_t>(r)]) views.push_back(t.view());
    ranks[static_cast<size_t>(r)].plan.set_grads(views);
  }
  sharded_step(ranks);
  whole.plan.step();
  expect_same(device(), ranks, whole, m, "set_grads");
  const std::vector<TensorView> one(ranks[0].gv.begin(), ranks[0].gv.begin() + 1);
  expect_error([&] { ranks[0].plan.set_grads(one); }, ErrorCode::size_mismatch, {"grads"});
  // Gradients in the plan's own exchange buffer: refused before any table changes.
  const TensorView exchange = ranks[0].plan.shard_buffer(0);
  std::vector<TensorView> inside = ranks[0].gv;
  inside[0].data = exchange.data;
  inside[0].dtype = DType::bf16;
  inside[0].numel = std::min(inside[0].numel, exchange.numel);
  expect_error([&] { ranks[0].plan.set_grads(inside); }, ErrorCode::aliasing, {"grads[0]", "shard_buffer"});
}

// Buckets change which launch and which exchange carries a matrix, not its
// numbers: 1, 2, 3 and 8 buckets, all at once, bucket by bucket or beside
// the stream, give the one-bucket step's bits, on every backend. The
// buckets are runs of whole shape classes in the order the classes first
// appear, more than one when more are asked and there are several
// classes, at most as many as asked, none empty, their FLOPs the plan's.
// (Here the exchanges go through the host, which waits for the device: a
// join that waited for nothing would pass. test_muon_sharded_streams runs
// the exchanges on the caller's stream, where it would not.)
TEST_P(MuonSharded, BucketsGiveTheSameBits) {
  uint64_t seed = 60;
  for (const Case& c : cases()) {
    std::mt19937_64 rng(seed++);
    const Model m = make_model(rng, c.shapes, c.ranks, c.d);
    const std::vector<std::vector<std::vector<double>>> grads = {m.gradients(rng), m.gradients(rng)};  // two steps'
    std::vector<std::vector<double>> first;  // the one-bucket run's weights and momentum, tensor by tensor
    for (const int32_t buckets : {1, 2, 3, 8}) {
      for (const int order : {0, 1, 2}) {  // all at once, bucket by bucket, beside
        if (buckets == 1 && order == 1) continue;
        MuonPlanOptions options;
        options.buckets = buckets;
        std::vector<Rank> ranks = make_ranks(device(), m, c.ranks, c.h, c.groups, options);
        const std::string what = c.name + ", " + std::to_string(buckets) + " buckets" +
                                 (order == 1 ? " one by one" : order == 2 ? " beside" : "");
        const MuonShardedPlan& plan = ranks[0].plan;
        ASSERT_GE(plan.num_buckets(), 1u) << what;
        ASSERT_LE(plan.num_buckets(), static_cast<size_t>(buckets)) << what;
        // Each class in one bucket; classes in first-appearance order, buckets not going down.
        std::vector<std::tuple<int64_t, int64_t, int32_t>> seen;
        std::vector<size_t> class_bucket;
        for (size_t i = 0; i < c.shapes.size(); ++i) {
          const auto key = std::make_tuple(c.shapes[i].rows, c.shapes[i].cols, c.groups.empty() ? 0 : c.groups[i]);
          const auto at = std::find(seen.begin(), seen.end(), key);
          for (int64_t k = 0; k < c.shapes[i].batch; ++k) {
            if (at == seen.end() && k == 0) {
              EXPECT_TRUE(class_bucket.empty() || plan.bucket(i, 0) >= class_bucket.back()) << what << " tensor " << i;
              seen.push_back(key);
              class_bucket.push_back(plan.bucket(i, 0));
            } else {
              const size_t cls = static_cast<size_t>(std::find(seen.begin(), seen.end(), key) - seen.begin());
              EXPECT_EQ(plan.bucket(i, k), class_bucket[cls]) << what << " tensor " << i << " matrix " << k;
            }
          }
        }
        if (buckets > 1 && seen.size() > 1) EXPECT_GT(plan.num_buckets(), 1u) << what;
        double flops = 0;
        for (size_t k = 0; k < plan.num_buckets(); ++k) {
          EXPECT_GT(plan.bucket_flops(k), 0.0) << what << " bucket " << k;
          flops += plan.bucket_flops(k);
        }
        double owned = 0;
        for (const Rank& r : ranks) owned += r.plan.owned_flops();
        EXPECT_DOUBLE_EQ(flops, owned) << what;
        for (const auto& g : grads) {
          for (int r = 0; r < c.ranks; ++r) ranks[static_cast<size_t>(r)].set_gradients(m, r, g);
          if (order == 0) sharded_step(ranks);
          else bucketed_step(ranks, order == 2);
        }
        std::vector<std::vector<double>> now;
        for (size_t i = 0; i < m.shapes.size(); ++i) {
          now.push_back(gathered(ranks, i, false));
          now.push_back(gathered(ranks, i, true));
        }
        if (first.empty()) first = now;
        EXPECT_EQ(now, first) << what;
      }
    }
  }
}

TEST_P(MuonSharded, RefusesBadSplitsAndRanks) {
  std::mt19937_64 rng(54);
  const Model m = make_model(rng, {{1, 24, 40}, {3, 16, 24}}, 2);
  const MuonHyperparameters h;
  Rank rank0(device(), m, 0, 2, std::span(&h, 1), {});
  const auto make = [&](std::vector<int64_t> splits, int32_t rank, int32_t ranks) {
    MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, m.shapes, splits, rank, ranks}, std::span(&h, 1));
  };
  const std::vector<int64_t> good = rank0.splits;  // {0, 12, 24, 0, 32, 48}
  make(good, 0, 2);
  expect_error([&] { make({0, 12, 24}, 0, 2); }, ErrorCode::size_mismatch, {"row_splits", "ranks + 1"});
  expect_error([&] { make({0, 12, 23, 0, 32, 48}, 0, 2); }, ErrorCode::invalid_argument,
               {"row_splits[0]", "24 rows"});
  expect_error([&] { make({0, 12, 24, 24, 0, 32, 16, 48}, 0, 3); }, ErrorCode::invalid_argument,
               {"row_splits[1]", "goes down at rank 1"});
  expect_error([&] { make({0, 10, 24, 0, 32, 48}, 0, 2); }, ErrorCode::size_mismatch,
               {"params[0]", "480 elements", "rows 0 to 10"});
  expect_error([&] { make(good, 2, 2); }, ErrorCode::invalid_argument, {"rank", "[0, ranks)"});
  expect_error([&] { make(good, 0, 0); }, ErrorCode::invalid_argument, {"ranks", ">= 1"});
  const std::vector<MatrixShape> bad_shape = {{1, 24, 40}, {0, 16, 24}};
  expect_error(
      [&] {
        MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, bad_shape, good, 0, 2}, std::span(&h, 1));
      },
      ErrorCode::invalid_argument, {"shapes[1]", ">= 1"});
  MuonHyperparameters nan_lr;
  nan_lr.lr = NAN;
  expect_error([&] { MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, m.shapes, good, 0, 2}, std::span(&nan_lr, 1)); },
               ErrorCode::invalid_argument, {"hyperparameters[0].lr"});
  expect_error([&] { rank0.plan.momentum({nullptr, 0.0f}); }, ErrorCode::invalid_argument, {"grad_scale"});
  for (const bool renormalize : {true, false}) {  // the result's scales need whole results
    MuonHyperparameters scaled;
    (renormalize ? scaled.renormalize : scaled.second_moment) = true;
    const std::string field = renormalize ? "hyperparameters[0].renormalize" : "hyperparameters[0].second_moment";
    expect_error([&] { MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, m.shapes, good, 0, 2}, std::span(&scaled, 1)); },
                 ErrorCode::invalid_argument, {field, "MuonPlan"});
    expect_error([&] { rank0.plan.set_hyperparameters(std::span(&scaled, 1)); }, ErrorCode::invalid_argument, {field});
  }
  MuonPlanOptions no_buckets;
  no_buckets.buckets = 0;
  expect_error(
      [&] { MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, m.shapes, good, 0, 2}, std::span(&h, 1), {}, no_buckets); },
      ErrorCode::invalid_argument, {"options.buckets", ">= 1"});
  // A huge count asks for no more buckets than there are classes.
  MuonPlanOptions huge;
  huge.buckets = std::numeric_limits<int32_t>::max();
  EXPECT_EQ(MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, m.shapes, good, 0, 2}, std::span(&h, 1), {}, huge)
                .num_buckets(), 2u);
  const size_t past = rank0.plan.num_buckets();
  const auto before = rank0.buf[0].bytes(), weights = rank0.w[0].bytes();
  expect_error([&] { rank0.plan.momentum(past, {}, {}); }, ErrorCode::invalid_argument, {"bucket", "buckets"});
  expect_error([&] { rank0.plan.orthogonalize(past, {}, {}); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { rank0.plan.update(past, {}, {}); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { rank0.plan.orthogonalize_beside(past); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { rank0.plan.join(past); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { (void)rank0.plan.shard_buffer(past); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { (void)rank0.plan.owner_buffer(past); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { (void)rank0.plan.shard_counts(past); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { (void)rank0.plan.owner_counts(past); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { (void)rank0.plan.bucket_flops(past); }, ErrorCode::invalid_argument, {"bucket"});
  expect_error([&] { (void)rank0.plan.bucket(2, 0); }, ErrorCode::invalid_argument, {"tensor, matrix"});
  // A valid bucket with bad inputs: refused, nothing written.
  expect_error([&] { rank0.plan.momentum(0, {nullptr, 0.0f}, {}); }, ErrorCode::invalid_argument, {"grad_scale"});
  expect_error([&] { rank0.plan.update(0, {nullptr, -1.0f}, {}); }, ErrorCode::invalid_argument, {"grad_scale"});
  EXPECT_EQ(rank0.buf[0].bytes(), before);
  EXPECT_EQ(rank0.w[0].bytes(), weights);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(MuonSharded);

}  // namespace
}  // namespace gradkit::test
