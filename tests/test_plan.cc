// The multi-tensor plan: chunking and the tables every backend walks.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/multi_tensor_plan.h"

namespace gradkit {
namespace {

TEST(MultiTensorPlan, CutsEveryTensorIntoChunksInOrder) {
  std::vector<float> storage(1000);
  const int64_t sizes[] = {0, 1, 16, 17, 300, 0, 64};
  std::vector<TensorView> list;
  int64_t offset = 0;
  for (int64_t n : sizes) {
    list.push_back(view(storage.data() + offset, n));
    offset += n;
  }
  const PlanList lists[] = {{"a", list, true}};
  const MultiTensorPlan plan("test", lists, 16);
  EXPECT_EQ(plan.num_tensors(), 7u);
  EXPECT_EQ(plan.total_elements(), 398);
  int64_t covered = 0;
  int last_tensor = -1;
  int64_t next_begin = 0;
  for (const PlanChunk& c : plan.chunks()) {
    EXPECT_GT(c.length, 0);
    EXPECT_LE(c.length, 16);
    if (c.tensor != last_tensor) {
      EXPECT_GT(c.tensor, last_tensor);
      EXPECT_EQ(c.begin, 0);
      last_tensor = c.tensor;
    } else {
      EXPECT_EQ(c.begin, next_begin);
    }
    next_begin = c.begin + c.length;
    covered += c.length;
  }
  EXPECT_EQ(covered, 398);
  EXPECT_EQ(plan.chunks().size(), 0u + 1 + 1 + 2 + 19 + 4);
  EXPECT_EQ(plan.pointers()[4], storage.data() + 34);
}

TEST(MultiTensorPlan, RejectsABadChunkSize) {
  std::vector<float> storage(10);
  const TensorView t[] = {view(storage.data(), 10)};
  const PlanList lists[] = {{"a", t, true}};
  EXPECT_THROW(MultiTensorPlan("test", lists, 12), Error);
  EXPECT_THROW(MultiTensorPlan("test", lists, 0), Error);
}

TEST(MultiTensorPlan, EmptyListIsAnEmptyPlan) {
  const PlanList lists[] = {{"a", {}, true}, {"b", {}, false}};
  const MultiTensorPlan plan("test", lists);
  EXPECT_TRUE(plan.empty());
  EXPECT_EQ(plan.num_tensors(), 0u);
}

}  // namespace
}  // namespace gradkit
