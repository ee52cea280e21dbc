// MuonShardedPlan over blocks (MuonShardedTensors::blocks): the layouts of
// DTensor parameters on tensor-, expert-parallel and 2-D meshes, ranks
// simulated in one process against the unsharded MuonPlan (bit for bit on
// the CPU; on CUDA the momentum bit for bit and the update within the
// products' tolerance, as test_muon_sharded). Plus: blocks of whole rows
// give the row_splits plan's bits, a rank that holds a whole matrix owns it
// and sends none of it, and bad blocks are refused before anything is made.
#include <gtest/gtest.h>

#include <random>
#include <string>
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

// The whole tensors and each rank's block of each.
struct Layout {
  std::vector<MatrixShape> shapes;
  std::vector<std::vector<MatrixBlock>> blocks;  // per tensor, one per rank
  std::vector<std::vector<double>> w, buf;
  int ranks;

  int64_t numel(size_t i) const { return shapes[i].batch * shapes[i].rows * shapes[i].cols; }
  std::vector<MatrixBlock> flat() const {
    std::vector<MatrixBlock> out;
    for (const auto& b : blocks) out.insert(out.end(), b.begin(), b.end());
    return out;
  }
};

// Each tensor cut on `mesh` by `sides` (mesh_blocks), random values.
Layout make_layout(std::mt19937_64& rng, const std::vector<MatrixShape>& shapes, const std::vector<int>& mesh,
                   const std::vector<std::vector<int>>& sides) {
  Layout l{shapes, {}, {}, {}, 1};
  for (const int n : mesh) l.ranks *= n;
  for (size_t i = 0; i < shapes.size(); ++i) {
    l.blocks.push_back(mesh_blocks(shapes[i], mesh, sides[i]));
    l.w.push_back(random_values(rng, l.numel(i)));
    l.buf.push_back(random_values(rng, l.numel(i), 0.1));
  }
  return l;
}

// One rank: its block of every tensor and its plan.
struct Rank {
  std::vector<TestTensor> w, g, buf;
  std::vector<TensorView> wv, gv, bv;
  std::vector<MatrixBlock> blocks;
  MuonShardedPlan plan;

  Rank(Device device, const Layout& l, int rank, std::span<const MuonHyperparameters> h) : blocks(l.flat()) {
    for (size_t i = 0; i < l.shapes.size(); ++i) {
      const MatrixBlock& b = l.blocks[i][static_cast<size_t>(rank)];
      w.emplace_back(device, DType::f32, block_of(l.w[i], l.shapes[i], b));
      g.emplace_back(device, DType::f32, std::vector<double>(static_cast<size_t>(b.numel()), 0.0));
      buf.emplace_back(device, DType::f32, block_of(l.buf[i], l.shapes[i], b));
    }
    for (auto& t : w) wv.push_back(t.view());
    for (auto& t : g) gv.push_back(t.view());
    for (auto& t : buf) bv.push_back(t.view());
    plan = MuonShardedPlan({wv, gv, bv, l.shapes, {}, rank, l.ranks, blocks}, h);
  }
};

std::vector<Rank> make_ranks(Device device, const Layout& l, std::span<const MuonHyperparameters> h) {
  std::vector<Rank> ranks;
  ranks.reserve(static_cast<size_t>(l.ranks));
  for (int r = 0; r < l.ranks; ++r) ranks.emplace_back(device, l, r, h);
  return ranks;
}

// The ranks' blocks of tensor i put back together.
std::vector<double> gathered(const std::vector<Rank>& ranks, const Layout& l, size_t i, bool momentum) {
  std::vector<double> out(static_cast<size_t>(l.numel(i)), 0.0);
  for (size_t r = 0; r < ranks.size(); ++r) {
    put_block(out, l.shapes[i], l.blocks[i][r], (momentum ? ranks[r].buf : ranks[r].w)[i].read());
  }
  return out;
}

// Three steps of the sharded plan and of the whole one; their weights and
// momentum compared as the file's comment says.
void expect_unsharded_step(Device device, const Layout& l, std::span<const MuonHyperparameters> h,
                           std::mt19937_64& rng, const std::string& what) {
  std::vector<Rank> ranks = make_ranks(device, l, h);
  std::vector<TestTensor> w, g, buf;
  std::vector<TensorView> wv, gv, bv;
  for (size_t i = 0; i < l.shapes.size(); ++i) {
    w.emplace_back(device, DType::f32, l.w[i]);
    g.emplace_back(device, DType::f32, std::vector<double>(static_cast<size_t>(l.numel(i)), 0.0));
    buf.emplace_back(device, DType::f32, l.buf[i]);
    wv.push_back(w.back().view());
    gv.push_back(g.back().view());
    bv.push_back(buf.back().view());
  }
  const MuonPlan whole({wv, gv, bv, l.shapes}, h);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < l.shapes.size(); ++i) {
      const std::vector<double> grad = random_values(rng, l.numel(i));
      overwrite(g[i], grad);
      for (size_t r = 0; r < ranks.size(); ++r) overwrite(ranks[r].g[i], block_of(grad, l.shapes[i], l.blocks[i][r]));
    }
    sharded_step(ranks);
    whole.step();
  }
  for (size_t i = 0; i < l.shapes.size(); ++i) {
    const std::string where = what + " tensor " + std::to_string(i);
    EXPECT_EQ(gathered(ranks, l, i, true), buf[i].read()) << where << " momentum";
    const std::vector<double> got = gathered(ranks, l, i, false), want = w[i].read();
    if (device.is_cuda()) {
      std::vector<double> a(got.size()), b(got.size());
      for (size_t k = 0; k < got.size(); ++k) a[k] = got[k] - l.w[i][k], b[k] = want[k] - l.w[i][k];
      EXPECT_LE(relative_error(a, b), muon_update_tolerance(false)) << where << " update";
    } else {
      EXPECT_EQ(got, want) << where << " weights";
    }
  }
}

using MuonBlocks = OnEachDevice;

MuonHyperparameters fast() {
  MuonHyperparameters h;
  h.lr = 0.02;
  return h;
}

const std::vector<MatrixShape> kShapes = {{1, 24, 40}, {1, 40, 24}, {1, 7, 33}, {3, 16, 24}};

// Tensor parallelism on 2 and 3 ranks: column-parallel linears (Shard(0),
// rows), row-parallel ones (Shard(1), columns), uneven where the side does
// not divide; a 3-D stack cut by its columns.
TEST_P(MuonBlocks, TensorParallelRowsAndColumns) {
  std::mt19937_64 rng(70);
  const MuonHyperparameters h = fast();
  for (const int tp : {2, 3}) {
    const Layout cols = make_layout(rng, kShapes, {tp}, {{2}, {2}, {2}, {2}});
    expect_unsharded_step(device(), cols, std::span(&h, 1), rng, "Shard(1) on " + std::to_string(tp));
    const Layout mixed = make_layout(rng, kShapes, {tp}, {{1}, {2}, {2}, {1}});
    expect_unsharded_step(device(), mixed, std::span(&h, 1), rng, "Shard(0) and Shard(1) on " + std::to_string(tp));
  }
}

// 2-D meshes (FSDP x TP, 2 x 2 and 2 x 3): FSDP's rows over TP's columns
// (a row-parallel linear under fully_shard), FSDP's rows within TP's rows
// (a column-parallel one), and the recipe the sharded plan takes.
TEST_P(MuonBlocks, TwoDimensionalMeshes) {
  std::mt19937_64 rng(71);
  MuonHyperparameters recipe = fast();
  recipe.set_ns_coefficients(kPolarExpressCoefficients);
  recipe.divisor = MuonDivisor::polar_express;
  recipe.equilibrate_rows = true;
  recipe.cautious_weight_decay = true;
  for (const std::vector<int>& mesh : {std::vector<int>{2, 2}, std::vector<int>{2, 3}}) {
    const std::string name = std::to_string(mesh[0]) + " x " + std::to_string(mesh[1]);
    const Layout l = make_layout(rng, kShapes, mesh, {{1, 2}, {1, 1}, {1, 2}, {0, 2}});
    const MuonHyperparameters h = fast();
    expect_unsharded_step(device(), l, std::span(&h, 1), rng, name);
    expect_unsharded_step(device(), l, std::span(&recipe, 1), rng, name + " recipe");
  }
}

// Expert-parallel stacks (experts split over the ranks, two stacks of
// different shapes, as an MoE layer's up and down projections): every
// expert is orthogonalised where it is held, nothing is sent, and the
// weights are the unsharded step's.
TEST_P(MuonBlocks, ExpertsStayWhereTheyAre) {
  std::mt19937_64 rng(72);
  const std::vector<MatrixShape> shapes = {{6, 16, 24}, {6, 24, 16}, {12, 8, 8}};
  for (const int ranks_count : {2, 3}) {
    const Layout l = make_layout(rng, shapes, {ranks_count}, {{0}, {0}, {0}});
    const MuonHyperparameters h = fast();
    const std::vector<Rank> ranks = make_ranks(device(), l, std::span(&h, 1));
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t per_rank = shapes[i].batch / ranks_count;
      for (int64_t k = 0; k < shapes[i].batch; ++k)
        EXPECT_EQ(ranks[0].plan.owner(i, k), k / per_rank) << "tensor " << i << " expert " << k;
    }
    for (size_t r = 0; r < ranks.size(); ++r) {
      for (size_t k = 0; k < ranks[r].plan.num_buckets(); ++k) {
        const auto sent = ranks[r].plan.shard_counts(k);
        for (size_t o = 0; o < sent.size(); ++o)
          if (o != r) EXPECT_EQ(sent[o], 0) << "rank " << r << " bucket " << k << " to rank " << o;
      }
    }
    expect_unsharded_step(device(), l, std::span(&h, 1), rng, "experts");
  }
}

// Whole rows given as blocks are what row_splits says: the same bits.
TEST_P(MuonBlocks, RowBlocksAreRowSplits) {
  std::mt19937_64 rng(73);
  const Layout l = make_layout(rng, kShapes, {3}, {{1}, {1}, {1}, {0}});
  const MuonHyperparameters h = fast();
  expect_unsharded_step(device(), l, std::span(&h, 1), rng, "row blocks");
}

// Bad blocks: refused naming the entry and what was expected.
TEST_P(MuonBlocks, RefusesBlocksThatDoNotTileTheTensor) {
  std::mt19937_64 rng(74);
  const std::vector<MatrixShape> shapes = {{1, 8, 6}};
  const Layout l = make_layout(rng, shapes, {2}, {{2}});
  const MuonHyperparameters h = fast();
  Rank rank0(device(), l, 0, std::span(&h, 1));
  const auto make = [&](std::vector<MatrixBlock> blocks) {
    MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, shapes, {}, 0, 2, blocks}, std::span(&h, 1));
  };
  const std::vector<MatrixBlock> good = rank0.blocks;  // columns [0, 3) and [3, 6)
  make(good);
  expect_error([&] { make({good[0]}); }, ErrorCode::size_mismatch, {"blocks", "per parameter"});
  expect_error([&] { make({good[0], {0, 1, 0, 8, 3, 4}}); }, ErrorCode::invalid_argument,
               {"blocks[1] (tensor 0, rank 1)", "inside shapes[0]"});
  expect_error([&] { make({good[0], {0, 1, 0, 8, 2, 4}}); }, ErrorCode::invalid_argument,
               {"blocks[1] (tensor 0, rank 1)", "overlaps blocks[0]"});
  expect_error([&] { make({good[0], {0, 1, 0, 7, 3, 3}}); }, ErrorCode::invalid_argument,
               {"cover 45 of tensor 0's 48 elements"});
  expect_error([&] { make({{0, 1, 0, 8, 0, 2}, {0, 1, 0, 8, 2, 4}}); }, ErrorCode::size_mismatch,
               {"params[0]", "24 elements", "16"});
  expect_error([&] { make({{0, 1, 0, 8, -1, 3}, good[1]}); }, ErrorCode::invalid_argument, {"blocks[0]", ">= 0"});
  const std::vector<int64_t> splits = {0, 4, 8};
  expect_error(
      [&] { MuonShardedPlan({rank0.wv, rank0.gv, rank0.bv, shapes, splits, 0, 2, good}, std::span(&h, 1)); },
      ErrorCode::invalid_argument, {"row_splits, blocks", "both given"});
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(MuonBlocks);

}  // namespace
}  // namespace gradkit::test
