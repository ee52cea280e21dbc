// The NCCL communicator's fusion-buffer path: copy plans cached per list
// (the same list again builds none, another list builds one), and the
// pipelined all-reduce (pieces whose pack, collective and unpack overlap),
// with piece boundaries inside tensors, compared with a float64 reference.
// These run where every local rank has a GPU; elsewhere they skip.
#include <gtest/gtest.h>

#include <memory>
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

TEST_F(Fusion, PipelinedAllReduceMatchesTheFloat64Sum) {
  CommunicatorOptions options;
  options.fusion_pipeline_bytes = 1024;
  std::unique_ptr<Communicator> c = make_communicator(Backend::nccl, options);
  ASSERT_EQ(c->fusion_pipeline_bytes(), 1024u);
  struct Placement {
    Layout in;
    Layout out;
    bool in_place;
  };
  const Placement placements[] = {
      {Layout::with_gaps, Layout::with_gaps, true},
      {Layout::with_gaps, Layout::with_gaps, false},
      {Layout::back_to_back, Layout::with_gaps, false},
      {Layout::with_gaps, Layout::back_to_back, false},
  };
  uint64_t seed = 500;
  for (DType dtype : kAllDTypes) {
    for (const Placement& p : placements) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
        // Twice each: the second call runs on the cached plans.
        for (int call = 0; call < 2; ++call) {
          ++seed;
          const std::string what = std::string(dtype_name(dtype)) + (p.in_place ? " in place" : " out of place") +
                                   (p.in == Layout::with_gaps ? " gaps" : " back-to-back") + " -> " +
                                   (p.out == Layout::with_gaps ? "gaps" : "back-to-back") +
                                   (op == ReduceOp::average ? " average" : " sum") + " call " +
                                   std::to_string(call);
          TestList in(c->device(), dtype, kLarge, p.in);
          const std::vector<double> mine = rank_input(seed, c->rank(), in.total(), dtype);
          in.write(mine);
          if (p.in_place) {
            c->all_reduce(in.views(), op);
            c->wait();
            expect_reduced(in.read(), seed, c->size(), dtype, op == ReduceOp::average, 0, in.total(), what);
          } else {
            TestList out(c->device(), dtype, kLarge, p.out);
            out.write(rank_input(seed + 77777, c->rank(), in.total(), dtype));
            c->all_reduce(in.views(), out.views(), op);
            c->wait();
            expect_reduced(out.read(), seed, c->size(), dtype, op == ReduceOp::average, 0, in.total(), what);
            expect_equal(in.read(), mine, 0, in.total(), what + " (input untouched)");
          }
        }
      }
    }
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
