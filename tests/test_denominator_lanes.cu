// cuda/denominator_lanes.cuh against the compiler's correctly rounded
// operations: each fast sequence on every f32 in its range (all 2^32 bit
// patterns tested for the range, the result compared bit for bit with
// sqrt.rn and rcp.rn), and denominator_reciprocal_lane on lanes and eps that
// take either branch. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/denominator_lanes.cuh"
#include "support/check_cuda.h"
#include "support/test_tensor.h"

namespace {

using gradkit::cuda::denominator_reciprocal_lane;
using gradkit::cuda::reciprocal_fast_sequence;
using gradkit::cuda::reciprocal_in_range;
using gradkit::cuda::sqrt_fast_sequence;
using gradkit::cuda::sqrt_in_range;
using gradkit::test::cuda_available;

struct Counts {
  unsigned long long in_range, mismatched;
  uint32_t first_mismatch;
};

enum class Sequence { sqrt, reciprocal };

template <Sequence kSequence>
__global__ void check_every_f32(Counts* counts) {
  unsigned long long in_range = 0, mismatched = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    const auto bits = static_cast<uint32_t>(i);
    const float x = __uint_as_float(bits);
    bool same;
    if constexpr (kSequence == Sequence::sqrt) {
      if (!sqrt_in_range(x)) continue;
      same = __float_as_uint(sqrt_fast_sequence(x)) == __float_as_uint(__fsqrt_rn(x));
    } else {
      if (!reciprocal_in_range(x)) continue;
      same = __float_as_uint(reciprocal_fast_sequence(x)) == __float_as_uint(__frcp_rn(x));
    }
    ++in_range;
    if (!same && mismatched++ == 0) atomicMin(&counts->first_mismatch, bits);
  }
  atomicAdd(&counts->in_range, in_range);
  atomicAdd(&counts->mismatched, mismatched);
}

template <Sequence kSequence>
void check_every_f32(Counts& got) {
  Counts* counts = nullptr;
  CHECK_CUDA(cudaMalloc(&counts, sizeof(Counts)));
  const Counts start{0, 0, 0xffffffffu};
  CHECK_CUDA(cudaMemcpy(counts, &start, sizeof(Counts), cudaMemcpyHostToDevice));
  check_every_f32<kSequence><<<4096, 256>>>(counts);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaMemcpy(&got, counts, sizeof(Counts), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(counts));
}

TEST(DenominatorLanes, TheSqrtSequenceIsSqrtRnOnEveryF32InItsRange) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  Counts got{};
  check_every_f32<Sequence::sqrt>(got);
  // The range is [0x0d000000, 0x7f7fffff]: 2^-101 up to FLT_MAX.
  EXPECT_EQ(got.in_range, 0x7f7fffffull - 0x0d000000ull + 1);
  EXPECT_EQ(got.mismatched, 0u) << "first at bits 0x" << std::hex << got.first_mismatch;
}

TEST(DenominatorLanes, TheReciprocalSequenceIsRcpRnOnEveryF32InItsRange) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  Counts got{};
  check_every_f32<Sequence::reciprocal>(got);
  // Exponent fields 1 to 252, both signs, every fraction.
  EXPECT_EQ(got.in_range, 2ull * 252 * (1ull << 23));
  EXPECT_EQ(got.mismatched, 0u) << "first at bits 0x" << std::hex << got.first_mismatch;
}

constexpr int kLane = 8;

__global__ void lanes(const float* v, const float* eps, uint32_t* fast, uint32_t* reference, int lanes) {
  const int lane = blockIdx.x * blockDim.x + threadIdx.x;
  if (lane >= lanes) return;
  float x[kLane], reciprocal[kLane];
  for (int k = 0; k < kLane; ++k) x[k] = v[lane * kLane + k];
  denominator_reciprocal_lane(x, eps[lane], reciprocal);
  for (int k = 0; k < kLane; ++k) {
    fast[lane * kLane + k] = __float_as_uint(reciprocal[k]);
    reference[lane * kLane + k] = __float_as_uint(__frcp_rn(__fadd_rn(__fsqrt_rn(x[k]), eps[lane])));
  }
}

TEST(DenominatorLanes, EveryLaneGivesTheCorrectlyRoundedReciprocalOnEitherBranch) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  // Seeded lanes of positive values over the whole exponent range, half of
  // them with one value outside the square root's fast range (0, -0, a
  // denormal, 2^-110, a negative number, Inf, NaN), and each lane's eps from
  // both sides of the fast branch's [0, 2^64] (the usual ones, 0, the ends;
  // past 2^64, -0, a negative one, NaN), so that both branches run.
  std::mt19937 rng(38);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-126, 127), pick(0, kLane - 1);
  const float outside[] = {0.0f, -0.0f, 1e-40f, 0x1p-110f, -2.5f, INFINITY, NAN};
  const float eps_choices[] = {1e-8f, 1e-6f, 0.0f, 1e-30f, 0x1p64f, 0x1.000002p64f, 1e30f, -0.0f, -1e-8f, NAN};
  constexpr int kLanes = 1 << 14;
  std::vector<float> v(kLanes * kLane), eps(kLanes);
  for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
  for (int lane = 0; lane < kLanes; lane += 2) v[lane * kLane + pick(rng)] = outside[(lane / 2) % 7];
  for (int lane = 0; lane < kLanes; ++lane) eps[lane] = eps_choices[(lane / 3) % 10];
  float *dv = nullptr, *deps = nullptr;
  uint32_t *dfast = nullptr, *dref = nullptr;
  CHECK_CUDA(cudaMalloc(&dv, v.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&deps, eps.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dfast, v.size() * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&dref, v.size() * sizeof(uint32_t)));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(deps, eps.data(), eps.size() * sizeof(float), cudaMemcpyHostToDevice));
  lanes<<<kLanes / 128, 128>>>(dv, deps, dfast, dref, kLanes);
  CHECK_CUDA(cudaGetLastError());
  std::vector<uint32_t> fast(v.size()), reference(v.size());
  CHECK_CUDA(cudaMemcpy(fast.data(), dfast, fast.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(reference.data(), dref, reference.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(deps));
  CHECK_CUDA(cudaFree(dfast));
  CHECK_CUDA(cudaFree(dref));
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(fast[i], reference[i]) << "value " << i << " (v " << v[i] << ", eps " << eps[i / kLane] << ")";
  }
}

}  // namespace
