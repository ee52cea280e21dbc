// Adasum on every backend, compared with a float64 reference that builds the
// tree of pairwise combinations exactly as docs/ops.md states it (the ranks
// past the largest power of two folded into the first ones, then ranks
// (0, 1), (2, 3), ... and so on up). Every rank regenerates every rank's
// seeded input, so each knows the exact expected result; every rank must
// also hold bitwise the same result as rank 0.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "comm/comm_test_support.h"
#include "gradkit/comm/adasum.h"
#include "gradkit/core/error.h"

namespace gradkit::test {
namespace {

using Sizes = std::vector<int64_t>;

// Odd sizes: the halvings cut through tensors at every level.
const Sizes kOddSizes = {1, 7, 33, 1000, 3, 129};
// One large tensor spread over every rank's segment, between small ones.
const Sizes kCutSizes = {5, 3001, 17, 2, 640};
// A zero-size tensor in the middle of the list.
const Sizes kWithEmpty = {17, 0, 31};
const std::vector<Sizes> kSizeLists = {kOddSizes, kCutSizes, kWithEmpty};

// ---- the float64 reference

// A vector of the tree and, element by element, the sum of the magnitudes
// of the terms it was made of (|ca| |a| + |cb| |b|, recursively): where
// ca a and cb b cancel, the rounding errors are relative to these.
struct Combined {
  std::vector<double> value;
  std::vector<double> magnitude;
};

Combined leaf(const std::vector<double>& x) {
  Combined c{x, x};
  for (double& m : c.magnitude) m = std::abs(m);
  return c;
}

// adasum(a, b) tensor by tensor.
Combined adasum_pair(const Combined& a, const Combined& b, const Sizes& sizes) {
  Combined out{std::vector<double>(a.value.size()), std::vector<double>(a.value.size())};
  size_t at = 0;
  for (int64_t n : sizes) {
    const size_t end = at + static_cast<size_t>(n);
    double dot = 0, norm_a = 0, norm_b = 0;
    for (size_t i = at; i < end; ++i) {
      dot += a.value[i] * b.value[i];
      norm_a += a.value[i] * a.value[i];
      norm_b += b.value[i] * b.value[i];
    }
    const double ca = norm_a == 0 ? 1 : 1 - dot / (2 * norm_a);
    const double cb = norm_b == 0 ? 1 : 1 - dot / (2 * norm_b);
    for (size_t i = at; i < end; ++i) {
      out.value[i] = ca * a.value[i] + cb * b.value[i];
      out.magnitude[i] = std::abs(ca) * a.magnitude[i] + std::abs(cb) * b.magnitude[i];
    }
    at = end;
  }
  return out;
}

// The ranks past the largest power of two k fold into ranks 0, 1, ...
// (x_i = adasum(x_i, x_{i+k})), then pairs (0, 1), (2, 3), ... combine,
// then their results pairwise, up to one vector.
Combined adasum_tree(const std::vector<std::vector<double>>& inputs, const Sizes& sizes) {
  std::vector<Combined> v;
  for (const auto& x : inputs) v.push_back(leaf(x));
  size_t k = 1;
  while (2 * k <= v.size()) k *= 2;
  for (size_t i = 0; i + k < v.size(); ++i) v[i] = adasum_pair(v[i], v[i + k], sizes);
  v.resize(k);
  while (v.size() > 1) {
    std::vector<Combined> next;
    for (size_t i = 0; i < v.size(); i += 2) next.push_back(adasum_pair(v[i], v[i + 1], sizes));
    v = std::move(next);
  }
  return v[0];
}

int tree_levels(int vectors) {
  int levels = 0;
  while ((1 << levels) < vectors) ++levels;
  return levels;
}

std::vector<std::vector<double>> every_rank_input(uint64_t seed, int ranks, int64_t n, DType dtype) {
  std::vector<std::vector<double>> inputs;
  for (int r = 0; r < ranks; ++r) inputs.push_back(rank_input(seed, r, n, dtype));
  return inputs;
}

// Per tensor, ||got - want|| within `tolerance` times the norm of the
// magnitudes of the terms that made `want`.
void expect_close(const std::vector<double>& got, const Combined& want, const Sizes& sizes, double tolerance,
                  const std::string& what) {
  size_t at = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    double error = 0, magnitude = 0;
    bool nan_differs = false;
    for (size_t i = at; i < at + static_cast<size_t>(sizes[t]); ++i) {
      nan_differs = nan_differs || std::isnan(got[i]) != std::isnan(want.value[i]);
      error += (got[i] - want.value[i]) * (got[i] - want.value[i]);
      magnitude += want.magnitude[i] * want.magnitude[i];
    }
    EXPECT_FALSE(nan_differs) << what << ": tensor " << t;
    EXPECT_LE(std::sqrt(error), tolerance * std::sqrt(magnitude))
        << what << ": tensor " << t << " (" << sizes[t] << " elements), relative to the terms' magnitude "
        << std::sqrt(error / magnitude);
    at += static_cast<size_t>(sizes[t]);
  }
}

// Every rank holds bitwise rank 0's result.
void expect_same_on_every_rank(const std::vector<double>& got, const std::string& what) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<double> all(got.size() * static_cast<size_t>(size));
  MPI_Allgather(got.data(), static_cast<int>(got.size()), MPI_DOUBLE, all.data(), static_cast<int>(got.size()),
                MPI_DOUBLE, MPI_COMM_WORLD);
  for (int r = 1; r < size; ++r) {
    for (size_t i = 0; i < got.size(); ++i) {
      const double zero = all[i], other = all[static_cast<size_t>(r) * got.size() + i];
      if (std::memcmp(&zero, &other, sizeof(double)) != 0) {
        ADD_FAILURE() << what << ": element " << i << " is " << other << " on rank " << r << " and " << zero
                      << " on rank 0";
        return;
      }
    }
  }
}

std::string describe(DType dtype, Layout layout, size_t list) {
  return std::string(dtype_name(dtype)) + (layout == Layout::back_to_back ? " back-to-back" : " with-gaps") +
         " list " + std::to_string(list);
}

using Adasum = OnEachBackend;

TEST_P(Adasum, MatchesTheFloat64TreeOnEveryRank) {
  Communicator& c = comm();
  uint64_t seed = 9000;
  for (DType dtype : kAllDTypes) {
    for (size_t l = 0; l < kSizeLists.size(); ++l) {
      for (Layout layout : {Layout::back_to_back, Layout::with_gaps}) {
        const Sizes& sizes = kSizeLists[l];
        TestList list(c.device(), dtype, sizes, layout);
        AdasumPlan plan(c, list.views());
        // The plan runs twice on new data: it keeps the pointers, not the values.
        for (int run = 0; run < 2; ++run) {
          ++seed;
          const std::string what = describe(dtype, layout, l) + " run " + std::to_string(run);
          const auto inputs = every_rank_input(seed, c.size(), list.total(), dtype);
          list.write(inputs[static_cast<size_t>(c.rank())]);
          plan.run();
          c.wait();
          const std::vector<double> got = list.read();
          expect_close(got, adasum_tree(inputs, sizes), sizes, adasum_tolerance(dtype, tree_levels(c.size())), what);
          expect_same_on_every_rank(got, what);
        }
      }
    }
  }
}

TEST_P(Adasum, SameInputGivesBitwiseTheSameResult) {
  Communicator& c = comm();
  for (DType dtype : {DType::f32, DType::f16}) {
    TestList list(c.device(), dtype, kCutSizes, Layout::with_gaps);
    const std::vector<double> mine = rank_input(9500, c.rank(), list.total(), dtype);
    AdasumPlan plan(c, list.views());
    list.write(mine);
    plan.run();
    c.wait();
    const std::vector<double> first = list.read();
    list.write(mine);
    adasum_all_reduce(c, list.views());
    expect_equal(list.read(), first, 0, list.total(), std::string(dtype_name(dtype)) + " second run");
  }
}

// A contiguous list that needs no padding (its total a multiple of 32 bytes
// times every rank count up to 4) is reduced in its own memory, with no
// copy in or out: bitwise what the same values give through the plan's own
// buffer (a list with gaps).
TEST_P(Adasum, AContiguousUnpaddedListIsReducedInPlaceWithTheSameBits) {
  Communicator& c = comm();
  const Sizes sizes = {5, 3001, 17, 2, 815};  // 3840 elements: 32 bytes x 4 ranks x 30 for f32
  for (DType dtype : kAllDTypes) {
    TestList contiguous(c.device(), dtype, sizes, Layout::back_to_back);
    TestList gapped(c.device(), dtype, sizes, Layout::with_gaps);
    const auto inputs = every_rank_input(9550, c.size(), contiguous.total(), dtype);
    contiguous.write(inputs[static_cast<size_t>(c.rank())]);
    gapped.write(inputs[static_cast<size_t>(c.rank())]);
    adasum_all_reduce(c, contiguous.views());
    adasum_all_reduce(c, gapped.views());
    const std::string what = std::string(dtype_name(dtype)) + " in place";
    const std::vector<double> got = contiguous.read();
    expect_equal(got, gapped.read(), 0, contiguous.total(), what);
    expect_close(got, adasum_tree(inputs, sizes), sizes, adasum_tolerance(dtype, tree_levels(c.size())), what);
  }
}

TEST_P(Adasum, ParallelGradientsGiveTheGradient) {
  Communicator& c = comm();
  for (DType dtype : kAllDTypes) {
    TestList list(c.device(), dtype, kOddSizes, Layout::back_to_back);
    const std::vector<double> same = rank_input(9600, 0, list.total(), dtype);  // rank 0's on every rank
    list.write(same);
    adasum_all_reduce(c, list.views());
    // a·b = |a|² = |b|² bitwise, so each coefficient is exactly 1/2.
    expect_equal(list.read(), same, 0, list.total(), std::string(dtype_name(dtype)) + " a = b");
  }
}

TEST_P(Adasum, OrthogonalGradientsAddAndCoefficientsArePerTensor) {
  Communicator& c = comm();
  // Tensor 0: every rank the same (parallel); tensor 1: rank r non-zero
  // only where i % size() == r (orthogonal, disjoint supports). With
  // coefficients over the whole list instead of per tensor, neither would
  // come out exact.
  const Sizes sizes = {300, 1001};
  for (DType dtype : kAllDTypes) {
    TestList list(c.device(), dtype, sizes, Layout::with_gaps);
    const std::vector<double> shared = rank_input(9700, 0, sizes[0], dtype);
    std::vector<double> mine = shared, want = shared;
    for (int64_t i = 0; i < sizes[1]; ++i) {
      const std::vector<double> owner = rank_input(9701, static_cast<int>(i % c.size()), sizes[1], dtype);
      want.push_back(owner[static_cast<size_t>(i)]);
      mine.push_back(i % c.size() == c.rank() ? owner[static_cast<size_t>(i)] : 0.0);
    }
    list.write(mine);
    adasum_all_reduce(c, list.views());
    expect_equal(list.read(), want, 0, list.total(), std::string(dtype_name(dtype)) + " parallel, then orthogonal");
  }
}

TEST_P(Adasum, ZeroTensorsTakeCoefficientOne) {
  Communicator& c = comm();
  const Sizes sizes = {40, 50, 60};
  for (DType dtype : kAllDTypes) {
    TestList list(c.device(), dtype, sizes, Layout::back_to_back);
    auto inputs = every_rank_input(9800, c.size(), list.total(), dtype);
    for (int r = 0; r < c.size(); ++r) {
      auto& x = inputs[static_cast<size_t>(r)];
      if (r == 0) std::fill(x.begin(), x.begin() + 40, 0.0);  // tensor 0: zero on rank 0 only
      std::fill(x.begin() + 40, x.begin() + 90, 0.0);          // tensor 1: zero everywhere
    }
    list.write(inputs[static_cast<size_t>(c.rank())]);
    adasum_all_reduce(c, list.views());
    const std::vector<double> got = list.read();
    const std::string what = std::string(dtype_name(dtype)) + " zero tensors";
    expect_close(got, adasum_tree(inputs, sizes), sizes, adasum_tolerance(dtype, tree_levels(c.size())), what);
    expect_equal(got, std::vector<double>(got.size(), 0.0), 40, 90, what + " (all zero stays zero)");
    for (double x : got) ASSERT_TRUE(std::isfinite(x)) << what;
  }
}

TEST_P(Adasum, Float16DotProductsBeyondTheFloat16Range) {
  Communicator& c = comm();
  // Values around ±200 over 4096 elements: |a|² is about 1.6e8, far past
  // f16's 65504, so sums in f16 (or in f32 and rounded to f16) would be Inf.
  const Sizes sizes = {4096, 33};
  TestList list(c.device(), DType::f16, sizes, Layout::back_to_back);
  auto inputs = every_rank_input(9900, c.size(), list.total(), DType::f16);
  for (auto& x : inputs) {
    for (double& v : x) v = static_cast<double>(static_cast<float>(half(static_cast<float>(v * 200))));
  }
  list.write(inputs[static_cast<size_t>(c.rank())]);
  adasum_all_reduce(c, list.views());
  const std::vector<double> got = list.read();
  for (double x : got) ASSERT_TRUE(std::isfinite(x));
  expect_close(got, adasum_tree(inputs, sizes), sizes, adasum_tolerance(DType::f16, tree_levels(c.size())),
               "f16 x200");
}

TEST_P(Adasum, NonFiniteValuesMakeTheirTensorNaN) {
  Communicator& c = comm();
  const Sizes sizes = {64, 65};
  TestList list(c.device(), DType::f32, sizes, Layout::back_to_back);
  std::vector<double> mine = rank_input(9950, c.rank(), list.total(), DType::f32);
  if (c.rank() == c.size() - 1) mine[70] = INFINITY;  // in tensor 1
  list.write(mine);
  adasum_all_reduce(c, list.views());
  const std::vector<double> got = list.read();
  for (int64_t i = 0; i < 64; ++i) EXPECT_TRUE(std::isfinite(got[static_cast<size_t>(i)])) << "tensor 0, " << i;
  for (int64_t i = 64; i < 129; ++i) EXPECT_TRUE(std::isnan(got[static_cast<size_t>(i)])) << "tensor 1, " << i;
}

TEST_P(Adasum, HierarchicalSumsInsideNodesThenAdasumAcross) {
  Communicator& c = comm();
  constexpr int kRanksPerNode = 2;
  if (c.size() % kRanksPerNode != 0) GTEST_SKIP() << c.size() << " ranks do not make nodes of " << kRanksPerNode;
  AdasumOptions options;
  options.hierarchical = true;
  options.ranks_per_node = kRanksPerNode;
  const int nodes = c.size() / kRanksPerNode;
  uint64_t seed = 10000;
  for (DType dtype : kAllDTypes) {
    for (size_t l = 0; l < kSizeLists.size(); ++l) {
      ++seed;
      const Sizes& sizes = kSizeLists[l];
      TestList list(c.device(), dtype, sizes, Layout::with_gaps);
      const auto inputs = every_rank_input(seed, c.size(), list.total(), dtype);
      // The reference: each node's sum, then the Adasum tree over nodes.
      std::vector<std::vector<double>> node_sums(static_cast<size_t>(nodes),
                                                 std::vector<double>(static_cast<size_t>(list.total()), 0.0));
      for (int r = 0; r < c.size(); ++r) {
        for (size_t i = 0; i < node_sums[0].size(); ++i) {
          node_sums[static_cast<size_t>(r / kRanksPerNode)][i] += inputs[static_cast<size_t>(r)][i];
        }
      }
      list.write(inputs[static_cast<size_t>(c.rank())]);
      AdasumPlan plan(c, list.views(), options);
      plan.run();
      c.wait();
      const std::vector<double> got = list.read();
      const std::string what = describe(dtype, Layout::with_gaps, l) + " hierarchical";
      // One level of sums (two ranks per node), then the tree's levels.
      expect_close(got, adasum_tree(node_sums, sizes), sizes, adasum_tolerance(dtype, 1 + tree_levels(nodes)), what);
      expect_same_on_every_rank(got, what);
    }
  }
}

TEST_P(Adasum, HierarchicalOnOneHostIsTheSumOverItsRanks) {
  Communicator& c = comm();
  const int L = c.local_size();
  if (L != c.size() || (L & (L - 1)) != 0) GTEST_SKIP() << "needs every rank on one host, a power of two of them";
  AdasumOptions options;
  options.hierarchical = true;  // ranks_per_node 0: local_size(), so one node
  for (DType dtype : kAllDTypes) {
    TestList list(c.device(), dtype, kOddSizes, Layout::back_to_back);
    list.write(rank_input(10050, c.rank(), list.total(), dtype));
    adasum_all_reduce(c, list.views(), options);
    expect_reduced(list.read(), 10050, c.size(), dtype, false, 0, list.total(),
                   std::string(dtype_name(dtype)) + " one node");
  }
}

TEST_P(Adasum, InvalidArgumentsAreRejectedBeforeAnythingIsWritten) {
  Communicator& c = comm();
  TestList list(c.device(), DType::f32, {8, 9}, Layout::back_to_back);
  const std::vector<double> mine = rank_input(10100, c.rank(), list.total(), DType::f32);
  list.write(mine);
  std::vector<TensorView> views(list.views().begin(), list.views().end());

  std::vector<TensorView> elsewhere = views;
  elsewhere[1].device = c.device().is_cuda() ? Device::cpu() : Device::cuda(0);
  expect_error([&] { adasum_all_reduce(c, elsewhere); }, ErrorCode::device_mismatch, {"adasum", "'tensors[1]'"});
  std::vector<TensorView> mixed = views;
  mixed[1].dtype = DType::f16;
  expect_error([&] { adasum_all_reduce(c, mixed); }, ErrorCode::invalid_argument,
               {"'tensors[1]'", "is f16, expected f32"});
  std::vector<TensorView> overlapping = views;
  overlapping[1].data = static_cast<float*>(views[0].data) + 4;
  expect_error([&] { adasum_all_reduce(c, overlapping); }, ErrorCode::aliasing, {"adasum", "overlaps"});

  AdasumOptions three_per_node;
  three_per_node.hierarchical = true;
  three_per_node.ranks_per_node = 3;
  expect_error([&] { adasum_all_reduce(c, views, three_per_node); }, ErrorCode::invalid_argument,
               {"'options.ranks_per_node'", "is 3, expected a power of two dividing size()"});
  AdasumOptions flat_with_nodes;
  flat_with_nodes.ranks_per_node = 2;
  expect_error([&] { adasum_all_reduce(c, views, flat_with_nodes); }, ErrorCode::invalid_argument,
               {"'options.ranks_per_node'", "expected 0 unless options.hierarchical"});

  c.wait();
  expect_equal(list.read(), mine, 0, list.total(), "a rejected call wrote");
}

TEST_P(Adasum, CheckedModeNamesWhatDiffersOnEveryRank) {
  Communicator& c = comm();
  c.set_checked(true);
  const int last = c.size() - 1;
  const bool odd_one = c.rank() == last;
  {  // one element count differs
    TestList list(c.device(), DType::f32, {10, 20, odd_one ? int64_t{31} : int64_t{30}}, Layout::with_gaps);
    const std::vector<double> mine = rank_input(10200, c.rank(), list.total(), DType::f32);
    list.write(mine);
    expect_error([&] { adasum_all_reduce(c, list.views()); }, ErrorCode::size_mismatch,
                 {"adasum", "'tensors'", "tensor 2 has 30 elements on rank 0 and 31 on rank " + std::to_string(last)});
    c.wait();
    expect_equal(list.read(), mine, 0, list.total(), "a rejected call wrote");
  }
  if (c.size() % 2 == 0) {  // the options differ
    TestList list(c.device(), DType::f32, {64}, Layout::back_to_back);
    AdasumOptions options;
    options.hierarchical = odd_one;
    options.ranks_per_node = odd_one ? 2 : 0;
    expect_error([&] { adasum_all_reduce(c, list.views(), options); }, ErrorCode::invalid_argument,
                 {"rank 0 calls adasum, rank " + std::to_string(last) + " calls adasum(hierarchical, 2 ranks per node)"});
  }
  {  // and a matching call goes through, checked
    const Sizes sizes = {10, 20, 30};
    TestList list(c.device(), DType::f32, sizes, Layout::with_gaps);
    const auto inputs = every_rank_input(10201, c.size(), list.total(), DType::f32);
    list.write(inputs[static_cast<size_t>(c.rank())]);
    adasum_all_reduce(c, list.views());
    expect_close(list.read(), adasum_tree(inputs, sizes), sizes, adasum_tolerance(DType::f32, tree_levels(c.size())),
                 "checked adasum");
  }
  c.set_checked(false);
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(Adasum);

}  // namespace
}  // namespace gradkit::test
