// cuda/sqrt_lanes.cuh against the compiler's sqrt.rn: the fast sequence on
// every f32 in its range (all 2^32 bit patterns tested for the range, the
// result compared bit for bit), and sqrt_lane on lanes that take either
// branch. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda/sqrt_lanes.cuh"
#include "support/test_tensor.h"

namespace {

using gradkit::cuda::sqrt_fast_sequence;
using gradkit::cuda::sqrt_in_range;
using gradkit::cuda::sqrt_lane;
using gradkit::test::cuda_available;

struct Counts {
  unsigned long long in_range, mismatched;
  uint32_t first_mismatch;
};

__global__ void check_every_f32(Counts* counts) {
  unsigned long long in_range = 0, mismatched = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    const auto bits = static_cast<uint32_t>(i);
    const float x = __uint_as_float(bits);
    if (!sqrt_in_range(x)) continue;
    ++in_range;
    if (__float_as_uint(sqrt_fast_sequence(x)) != __float_as_uint(__fsqrt_rn(x))) {
      if (mismatched++ == 0) atomicMin(&counts->first_mismatch, bits);
    }
  }
  atomicAdd(&counts->in_range, in_range);
  atomicAdd(&counts->mismatched, mismatched);
}

constexpr int kLane = 8;

__global__ void lanes(const float* x, uint32_t* fast, uint32_t* reference, int lanes) {
  const int lane = blockIdx.x * blockDim.x + threadIdx.x;
  if (lane >= lanes) return;
  float v[kLane], root[kLane];
  for (int k = 0; k < kLane; ++k) v[k] = x[lane * kLane + k];
  sqrt_lane(v, root);
  for (int k = 0; k < kLane; ++k) {
    fast[lane * kLane + k] = __float_as_uint(root[k]);
    reference[lane * kLane + k] = __float_as_uint(__fsqrt_rn(v[k]));
  }
}

#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

TEST(SqrtLanes, TheFastSequenceIsSqrtRnOnEveryF32InItsRange) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  Counts* counts = nullptr;
  CHECK_CUDA(cudaMalloc(&counts, sizeof(Counts)));
  const Counts start{0, 0, 0xffffffffu};
  CHECK_CUDA(cudaMemcpy(counts, &start, sizeof(Counts), cudaMemcpyHostToDevice));
  check_every_f32<<<4096, 256>>>(counts);
  CHECK_CUDA(cudaGetLastError());
  Counts got{};
  CHECK_CUDA(cudaMemcpy(&got, counts, sizeof(Counts), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(counts));
  // The range is [0x0d000000, 0x7f7fffff]: 2^-101 up to FLT_MAX.
  EXPECT_EQ(got.in_range, 0x7f7fffffull - 0x0d000000ull + 1);
  EXPECT_EQ(got.mismatched, 0u) << "first at bits 0x" << std::hex << got.first_mismatch;
}

TEST(SqrtLanes, EveryLaneGivesSqrtRnOnEitherBranch) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  // Seeded lanes of positive values over the whole exponent range, half of
  // them with one value outside the fast range (0, -0, a denormal, 2^-110,
  // a negative number, Inf, NaN), so that both branches run.
  std::mt19937 rng(38);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-126, 127), pick(0, kLane - 1);
  const float outside[] = {0.0f, -0.0f, 1e-40f, 0x1p-110f, -2.5f, INFINITY, NAN};
  constexpr int kLanes = 1 << 14;
  std::vector<float> x(kLanes * kLane);
  for (float& v : x) v = std::ldexp(mantissa(rng), exponent(rng));
  for (int lane = 0; lane < kLanes; lane += 2) x[lane * kLane + pick(rng)] = outside[(lane / 2) % 7];
  float* dx = nullptr;
  uint32_t *dfast = nullptr, *dref = nullptr;
  CHECK_CUDA(cudaMalloc(&dx, x.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dfast, x.size() * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&dref, x.size() * sizeof(uint32_t)));
  CHECK_CUDA(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  lanes<<<kLanes / 128, 128>>>(dx, dfast, dref, kLanes);
  CHECK_CUDA(cudaGetLastError());
  std::vector<uint32_t> fast(x.size()), reference(x.size());
  CHECK_CUDA(cudaMemcpy(fast.data(), dfast, fast.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(reference.data(), dref, reference.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(dx));
  CHECK_CUDA(cudaFree(dfast));
  CHECK_CUDA(cudaFree(dref));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(fast[i], reference[i]) << "value " << i << " (" << x[i] << ")";
  }
}

}  // namespace
