// The gradient arena (one allocation, aligned views, one collective) and
// bucketed all-reduce, on every backend.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "comm/comm_test_support.h"
#include "gradkit/comm/gradient_arena.h"
#include "gradkit/core/error.h"

#if defined(GRADKIT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace gradkit::test {
namespace {

const std::vector<int64_t> kModel = {1, 7, 33, 1000, 3, 129, 64, 200};

// Writes the concatenation `values` into the arena's gradients.
void write(const GradientArena& arena, const std::vector<double>& values) {
  TestList staging(Device::cpu(), arena.dtype(), kModel, Layout::back_to_back);
  staging.write(values);
  for (size_t i = 0; i < arena.size(); ++i) {
    copy_from_host(arena[i].data, arena.device(), staging.views()[i].data, arena[i].bytes());
  }
}

std::vector<double> read(const GradientArena& arena) {
  TestList staging(Device::cpu(), arena.dtype(), kModel, Layout::back_to_back);
  for (size_t i = 0; i < arena.size(); ++i) {
    copy_to_host(staging.views()[i].data, arena[i].data, arena[i].bytes(), arena.device());
  }
  return staging.read();
}

int64_t total() {
  int64_t n = 0;
  for (int64_t s : kModel) n += s;
  return n;
}

TEST(GradientArena, GradientsAreAlignedViewsIntoOneBuffer) {
  for (DType dtype : kAllDTypes) {
    const GradientArena arena(Device::cpu(), dtype, kModel);
    ASSERT_EQ(arena.size(), kModel.size());
    const auto* base = static_cast<const unsigned char*>(arena.buffer().data());
    for (size_t i = 0; i < arena.size(); ++i) {
      EXPECT_EQ(arena[i].numel, kModel[i]);
      EXPECT_EQ(arena[i].dtype, dtype);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(arena[i].data) % 256, 0u) << "gradient " << i;
      const auto* p = static_cast<const unsigned char*>(arena[i].data);
      EXPECT_GE(p, base);
      EXPECT_LE(p + arena[i].bytes(), base + arena.buffer().bytes());
    }
    EXPECT_EQ(arena.flat().data, arena[0].data);
    EXPECT_EQ(static_cast<const unsigned char*>(arena.flat().data) + arena.flat().bytes(),
              static_cast<const unsigned char*>(arena[arena.size() - 1].data) + arena[arena.size() - 1].bytes());

    const GradientArena packed(Device::cpu(), dtype, kModel, dtype_size(dtype));
    for (size_t i = 1; i < packed.size(); ++i) {
      EXPECT_EQ(packed[i].data, static_cast<unsigned char*>(packed[i - 1].data) + packed[i - 1].bytes());
    }
    EXPECT_EQ(packed.flat().numel, total());
  }
}

TEST(GradientArena, RejectsBadArguments) {
  for (size_t alignment : {size_t{2}, size_t{3}, size_t{512}}) {
    try {
      GradientArena(Device::cpu(), DType::f32, kModel, alignment);
      ADD_FAILURE() << "alignment " << alignment << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'alignment'"), std::string::npos) << e.what();
    }
  }
  const std::vector<int64_t> negative = {4, -1};
  EXPECT_THROW(GradientArena(Device::cpu(), DType::f32, negative), Error);
}

using Arena = OnEachBackend;

TEST_P(Arena, AllReduceIsOneCollectiveOverTheArena) {
  Communicator& c = comm();
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
      const uint64_t seed = 8000 + static_cast<uint64_t>(dtype) * 2 + (op == ReduceOp::average);
      const GradientArena arena(c.device(), dtype, kModel);
      write(arena, rank_input(seed, c.rank(), total(), dtype));
      arena.all_reduce(c, op);
      c.wait();
      expect_reduced(read(arena), seed, c.size(), dtype, op == ReduceOp::average, 0, total(),
                     std::string("arena ") + std::string(dtype_name(dtype)));
      // The alignment gaps took part in the collective and are still zero.
      std::vector<unsigned char> bytes(arena.buffer().bytes());
      copy_to_host(bytes.data(), arena.buffer().data(), bytes.size(), arena.device());
      size_t inside = 0;
      for (size_t i = 0; i < arena.size(); ++i) {
        const size_t begin = static_cast<const unsigned char*>(arena[i].data) -
                             static_cast<const unsigned char*>(arena.buffer().data());
        for (size_t b = inside; b < begin; ++b) ASSERT_EQ(bytes[b], 0) << "gap byte " << b;
        inside = begin + arena[i].bytes();
      }
    }
  }
}

TEST_P(Arena, BackToBackGradientsTakeTheListsContiguousPath) {
  std::unique_ptr<Communicator> fresh = make_communicator(GetParam());
  const GradientArena arena(fresh->device(), DType::f32, kModel, 4);
  write(arena, rank_input(8100, fresh->rank(), total(), DType::f32));
  fresh->all_reduce(arena.gradients());
  fresh->wait();
  EXPECT_EQ(fresh->fusion_buffer_bytes(), 0u);
  expect_reduced(read(arena), 8100, fresh->size(), DType::f32, false, 0, total(), "back-to-back arena");
}

// Bucketed all-reduce over two steps, gradients marked in backward order
// (last first) in the first and in forward order in the second. On CUDA the
// gradients are produced on a compute stream and reduced on a separate
// communication stream.
TEST_P(Arena, BucketsAreReducedAsTheirGradientsBecomeReady) {
  Communicator& c = comm();
  const GradientArena arena(c.device(), DType::f32, kModel);
  Stream compute{}, communication{};
#if defined(GRADKIT_WITH_CUDA)
  cudaStream_t streams[2] = {nullptr, nullptr};
  if (c.device().is_cuda()) {
    cudaSetDevice(c.device().index);
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[0], cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[1], cudaStreamNonBlocking), cudaSuccess);
    compute = Stream{streams[0]};
    communication = Stream{streams[1]};
  }
#endif
  BucketedAllReduce buckets(arena, c, 512, ReduceOp::sum, communication);
  ASSERT_GT(buckets.num_buckets(), 2u);
  for (size_t i = 1; i < arena.size(); ++i) EXPECT_GE(buckets.bucket_of(i), buckets.bucket_of(i - 1));

  for (int step = 0; step < 2; ++step) {
    const uint64_t seed = 8200 + static_cast<uint64_t>(step);
    // The values come from a staging copy of the arena; each gradient is
    // "produced" by a copy on the compute stream just before it is marked.
    const GradientArena staging(c.device(), DType::f32, kModel);
    write(staging, rank_input(seed, c.rank(), total(), DType::f32));
    for (size_t k = 0; k < arena.size(); ++k) {
      const size_t i = step == 0 ? arena.size() - 1 - k : k;
#if defined(GRADKIT_WITH_CUDA)
      if (c.device().is_cuda()) {
        ASSERT_EQ(cudaMemcpyAsync(arena[i].data, staging[i].data, arena[i].bytes(), cudaMemcpyDeviceToDevice,
                                  static_cast<cudaStream_t>(compute.handle)),
                  cudaSuccess);
      }
#endif
      if (!c.device().is_cuda()) std::memcpy(arena[i].data, staging[i].data, arena[i].bytes());
      buckets.mark_ready(i, compute);
    }
    buckets.finish(compute);
    c.wait(compute);
    expect_reduced(read(arena), seed, c.size(), DType::f32, false, 0, total(), "bucketed step " + std::to_string(step));
  }

  buckets.mark_ready(0, compute);
  EXPECT_THROW(buckets.mark_ready(0, compute), Error);
  buckets.finish(compute);  // every rank started the same buckets; finish the step
  c.wait(compute);
#if defined(GRADKIT_WITH_CUDA)
  for (cudaStream_t s : streams) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
#endif
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(Arena);

}  // namespace
}  // namespace gradkit::test
