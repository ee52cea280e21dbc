// The NCCL communicator's path for lists that are not contiguous: copy plans
// cached per list (the same list again builds none, another list builds
// one), the pipelined all-reduce (pieces whose pack, collective and unpack
// overlap, piece boundaries inside tensors), and large tensors reduced where
// they lie beside packed small ones, compared with a float64 reference.
// These run where every local rank has a GPU; elsewhere they skip.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

#include "comm/comm_test_support.h"

namespace gradkit::test {
namespace {

// Gaps between the tensors make the list take the fusion buffer. A's total
// (5280) needs no padding for 2 or 4 ranks, so that all-gather and
// reduce-scatter of A fit the fusion buffer its all-reduce sized (a new
// fusion buffer would rightly need new plans).
const std::vector<int64_t> kSizesA = {1000, 7, 33, 4096, 3, 141};
const std::vector<int64_t> kSizesB = {513, 2048, 1, 0, 77};
// 12,345 elements: with pieces of 1 KiB, dozens of pieces, most boundaries
// inside a tensor.
const std::vector<int64_t> kLarge = {5000, 1, 3001, 777, 0, 3566};

class Fusion : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = backend_unavailable_reason(Backend::nccl);
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
};

// All-reduces `list` in place with fresh inputs for `seed` and checks the sum.
void all_reduce_and_check(Communicator& c, TestList& list, uint64_t seed, const std::string& what) {
  list.write(rank_input(seed, c.rank(), list.total(), DType::f32));
  c.all_reduce(list.views(), ReduceOp::sum);
  c.wait();
  expect_reduced(list.read(), seed, c.size(), DType::f32, false, 0, list.total(), what);
}

TEST_F(Fusion, APlanIsBuiltOncePerListAndReused) {
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl);
  TestList a(c->device(), DType::f32, kSizesA, Layout::with_gaps);
  TestList b(c->device(), DType::f32, kSizesB, Layout::with_gaps);
  ASSERT_EQ(c->fusion_plans_built(), 0u);

  all_reduce_and_check(*c, a, 1, "list A, first call");
  EXPECT_EQ(c->fusion_plans_built(), 1u) << "the first call with a list plans it";
  all_reduce_and_check(*c, a, 2, "list A, second call");
  all_reduce_and_check(*c, a, 3, "list A, third call");
  EXPECT_EQ(c->fusion_plans_built(), 1u) << "the same list again must reuse its plan";

  all_reduce_and_check(*c, b, 4, "list B");
  EXPECT_EQ(c->fusion_plans_built(), 2u) << "another list needs its own plan";
  all_reduce_and_check(*c, a, 5, "list A after list B");
  all_reduce_and_check(*c, b, 6, "list B after list A");
  EXPECT_EQ(c->fusion_plans_built(), 2u) << "both lists' plans stay cached";

  // The same pointers with another element count are another list.
  std::vector<TensorView> shorter(a.views().begin(), a.views().end());
  shorter[3].numel -= 1;
  c->all_reduce(shorter, ReduceOp::sum);
  c->wait();
  EXPECT_EQ(c->fusion_plans_built(), 3u) << "a changed element count must not reuse the old plan";

  // All-gather and reduce-scatter pack and unpack with the same plan.
  a.write(rank_input(7, c->rank(), a.total(), DType::f32));
  c->all_gather(a.views());
  c->reduce_scatter(a.views());
  c->wait();
  EXPECT_EQ(c->fusion_plans_built(), 3u) << "all-gather and reduce-scatter of list A reuse its plan";
}

// DDP calls a hook once per bucket, each bucket a list of its own, every
// step: the plans of a few hundred lists passed in turn must all stay cached.
TEST_F(Fusion, ListsPassedInTurnKeepTheirPlans) {
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl);
  constexpr int kBuckets = 60;
  std::vector<TestList> buckets;
  buckets.reserve(kBuckets);
  for (int b = 0; b < kBuckets; ++b) buckets.emplace_back(c->device(), DType::f32, kSizesA, Layout::with_gaps);
  for (int step = 0; step < 3; ++step) {
    for (int b = 0; b < kBuckets; ++b) {
      all_reduce_and_check(*c, buckets[static_cast<size_t>(b)], 100 + static_cast<uint64_t>(step * kBuckets + b),
                           "bucket " + std::to_string(b) + ", step " + std::to_string(step));
    }
    EXPECT_EQ(c->fusion_plans_built(), static_cast<size_t>(kBuckets)) << "step " << step;
  }
}

TEST_F(Fusion, OutOfPlaceListsHaveAPlanEach) {
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl);
  TestList in(c->device(), DType::f32, kSizesA, Layout::with_gaps);
  TestList out(c->device(), DType::f32, kSizesA, Layout::with_gaps);
  for (uint64_t seed = 10; seed < 13; ++seed) {
    const std::vector<double> mine = rank_input(seed, c->rank(), in.total(), DType::f32);
    in.write(mine);
    c->all_reduce(in.views(), out.views(), ReduceOp::average);
    c->wait();
    expect_reduced(out.read(), seed, c->size(), DType::f32, true, 0, in.total(), "out of place");
    expect_equal(in.read(), mine, 0, in.total(), "out of place (input untouched)");
  }
  EXPECT_EQ(c->fusion_plans_built(), 2u) << "one plan for the inputs, one for the outputs, built once";
}

// Every dtype, in place and out of place, scattered and contiguous sides,
// sum and average, each case twice (the second call runs on cached plans):
// `sizes` all-reduced by `c` and compared with the float64 reference.
void check_every_placement(Communicator& c, const std::vector<int64_t>& sizes, uint64_t seed) {
  const Placement placements[] = {
      {Layout::with_gaps, Layout::with_gaps, true},
      {Layout::with_gaps, Layout::with_gaps, false},
      {Layout::back_to_back, Layout::with_gaps, false},
      {Layout::with_gaps, Layout::back_to_back, false},
  };
  for (DType dtype : kAllDTypes) {
    for (const Placement& p : placements) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
        for (int call = 0; call < 2; ++call) {
          ++seed;
          const std::string what = std::string(dtype_name(dtype)) + (p.in_place ? " in place" : " out of place") +
                                   (p.in == Layout::with_gaps ? " gaps" : " back-to-back") + " -> " +
                                   (p.out == Layout::with_gaps ? "gaps" : "back-to-back") +
                                   (op == ReduceOp::average ? " average" : " sum") + " call " +
                                   std::to_string(call);
          check_all_reduce(c, dtype, sizes, p, op, seed, what);
        }
      }
    }
  }
}

TEST_F(Fusion, PipelinedAllReduceMatchesTheFloat64Sum) {
  CommunicatorOptions options;
  options.fusion_pipeline_bytes = 1024;
  options.direct_tensor_bytes = 0;  // everything packed
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
  ASSERT_EQ(c->fusion_pipeline_bytes(), 1024u);
  check_every_placement(*c, kLarge, 500);
}

// Tensors of at least direct_tensor_bytes are reduced where they lie, the
// rest packed: with 4 KiB, every dtype has both kinds in kMixed (2048
// elements of f16 is exactly 4 KiB and goes direct). With 1 byte, every
// tensor goes direct and the fusion buffer is not used.
const std::vector<int64_t> kMixed = {5000, 1, 3001, 777, 0, 3566, 2048, 17};

TEST_F(Fusion, LargeTensorsReducedWhereTheyLieMatchTheFloat64Sum) {
  for (size_t direct : {size_t{4096}, size_t{1}}) {
    SCOPED_TRACE("direct_tensor_bytes = " + std::to_string(direct));
    CommunicatorOptions options;
    options.direct_tensor_bytes = direct;
    std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
    check_every_placement(*c, kMixed, 700 + direct);
    if (direct == 1) EXPECT_EQ(c->fusion_buffer_bytes(), 0u) << "every tensor went direct";
  }
}

TEST_F(Fusion, TheFusionBufferHoldsOnlyThePackedTensors) {
  CommunicatorOptions options;
  options.direct_tensor_bytes = 4096;
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
  TestList list(c->device(), DType::f32, kMixed, Layout::with_gaps);
  all_reduce_and_check(*c, list, 800, "mixed list, first call");
  // f32 tensors under 4 KiB: 1, 777 and 17 elements.
  EXPECT_EQ(c->fusion_buffer_bytes(), (1 + 777 + 17) * sizeof(float));
  const size_t plans = c->fusion_plans_built();
  EXPECT_EQ(plans, 2u) << "one split of the list and one copy plan for its packed tensors";
  all_reduce_and_check(*c, list, 801, "mixed list, second call");
  EXPECT_EQ(c->fusion_plans_built(), plans) << "the same list again must reuse its plans";
}

// Ranks that lay the list out differently still issue the same collectives:
// with small thresholds, both the split (direct and packed tensors) and the
// pipelined pieces. A mismatch would hang; the short timeout turns that into
// a failure.
TEST_F(Fusion, RanksWithDifferentLayoutsIssueTheSameCollectives) {
  const Layout mine = Layout::with_gaps;
  for (const auto& [direct, pieces, sizes] : {std::tuple{size_t{4096}, size_t{1} << 20, kMixed},
                                               std::tuple{size_t{0}, size_t{1024}, kLarge}}) {
    SCOPED_TRACE("direct_tensor_bytes " + std::to_string(direct) + ", fusion_pipeline_bytes " +
                 std::to_string(pieces));
    CommunicatorOptions options;
    options.direct_tensor_bytes = direct;
    options.fusion_pipeline_bytes = pieces;
    options.timeout = std::chrono::seconds(30);
    std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
    const Layout layout = c->rank() % 2 == 0 ? Layout::back_to_back : mine;
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
      check_all_reduce(*c, DType::f32, sizes, Placement{layout, layout, true}, op, 950 + direct,
                       "rank " + std::to_string(c->rank()) +
                           (layout == Layout::back_to_back ? " back to back" : " with gaps"));
    }
  }
}

// A back-to-back list copies only what the split packs: nothing in pieces,
// only its small tensors when it has a large one.
TEST_F(Fusion, BackToBackListsUseTheFusionBufferOnlyForPackedTensors) {
  {
    CommunicatorOptions options;
    options.direct_tensor_bytes = 0;
    options.fusion_pipeline_bytes = 1024;
    std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
    TestList list(c->device(), DType::f32, kLarge, Layout::back_to_back);
    all_reduce_and_check(*c, list, 960, "back to back, in pieces");
    EXPECT_EQ(c->fusion_buffer_bytes(), 0u) << "the pieces of a back-to-back list need no fusion buffer";
  }
  {
    CommunicatorOptions options;
    options.direct_tensor_bytes = 4096;
    std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
    TestList list(c->device(), DType::f32, kMixed, Layout::back_to_back);
    all_reduce_and_check(*c, list, 961, "back to back, split");
    EXPECT_EQ(c->fusion_buffer_bytes(), (1 + 777 + 17) * sizeof(float)) << "only the small tensors are packed";
  }
}

// More operations than one NCCL group takes (1024 per group): the list is
// reduced in several groups.
TEST_F(Fusion, ManyDirectTensorsTakeSeveralGroups) {
  CommunicatorOptions options;
  options.direct_tensor_bytes = 1;
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
  TestList list(c->device(), DType::f32, std::vector<int64_t>(2500, 3), Layout::with_gaps);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
    list.write(rank_input(900, c->rank(), list.total(), DType::f32));
    c->all_reduce(list.views(), op);
    c->wait();
    expect_reduced(list.read(), 900, c->size(), DType::f32, op == ReduceOp::average, 0, list.total(),
                   "2500 direct tensors");
  }
}

TEST_F(Fusion, PipelinedCallsInARowAreOrdered) {
  CommunicatorOptions options;
  options.fusion_pipeline_bytes = 2048;
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
  TestList list(c->device(), DType::f32, kLarge, Layout::with_gaps);
  // Back to back on the default stream with no host wait in between: each
  // call's pieces must start after the previous call's unpack.
  list.write(rank_input(900, c->rank(), list.total(), DType::f32));
  for (int i = 0; i < 3; ++i) c->all_reduce(list.views(), ReduceOp::average);
  c->wait();
  // Averaging three times an average over ranks leaves the average.
  expect_reduced(list.read(), 900, c->size(), DType::f32, true, 0, list.total(), "three averages in a row");
}

}  // namespace
}  // namespace gradkit::test
