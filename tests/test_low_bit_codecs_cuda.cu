// The CUDA kernels' encode (cuda/low_bit_codecs.cuh, bucketed_count_cuda:
// a float clamp and a predicated add) on every f32 bit pattern, in each of
// the four tables the kernels encode with (8- and 4-bit, signed and
// unsigned): the same count as the CPU backend's encode (spec::
// bucketed_count) everywhere, and as the encodes'
// definition, the binary search's count of decision points below x
// (spec::count_below), on their domain: |x| < 2 and NaN (a scaled moment
// is at most 1 and a rounding; from 2 up both encodes give 0, where the
// search gives the last code). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_int8_math.h"
#include "spec/low_bit_tables.h"
#include "cuda/low_bit_codecs.cuh"
#include "support/check_cuda.h"
#include "support/test_tensor.h"

namespace {

using namespace gradkit;
using gradkit::test::cuda_available;

struct Counts {
  unsigned long long against_cpu, against_search;
  uint32_t first_against_cpu, first_against_search;
};

template <class Table, bool kSigned>
__global__ void check_every_f32(const Table* table, Counts* counts) {
  unsigned long long against_cpu = 0, against_search = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    const auto bits = static_cast<uint32_t>(i);
    const float x = __uint_as_float(bits);
    const uint32_t got = cuda::bucketed_count_cuda<Table, kSigned>(*table, x);
    const uint32_t cpu = spec::bucketed_count(*table, x);
    if (got != cpu && against_cpu++ == 0) atomicMin(&counts->first_against_cpu, bits);
    const bool in_domain = !(fabsf(x) >= 2.0f);  // NaN too
    if (in_domain && got != spec::count_below(table->midpoints, x) && against_search++ == 0) {
      atomicMin(&counts->first_against_search, bits);
    }
  }
  atomicAdd(&counts->against_cpu, against_cpu);
  atomicAdd(&counts->against_search, against_search);
}

template <class Table, bool kSigned>
void expect_every_f32_counts_as_the_cpu_encode(const Table& host) {
  Table* table = nullptr;
  Counts* counts = nullptr;
  CHECK_CUDA(cudaMalloc(&table, sizeof(Table)));
  CHECK_CUDA(cudaMalloc(&counts, sizeof(Counts)));
  CHECK_CUDA(cudaMemcpy(table, &host, sizeof(Table), cudaMemcpyHostToDevice));
  const Counts start{0, 0, 0xffffffffu, 0xffffffffu};
  CHECK_CUDA(cudaMemcpy(counts, &start, sizeof(Counts), cudaMemcpyHostToDevice));
  check_every_f32<Table, kSigned><<<4096, 256>>>(table, counts);
  CHECK_CUDA(cudaGetLastError());
  Counts got{};
  CHECK_CUDA(cudaMemcpy(&got, counts, sizeof(Counts), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(table));
  CHECK_CUDA(cudaFree(counts));
  EXPECT_EQ(got.against_cpu, 0u) << "against the CPU's encode, first at bits 0x" << std::hex << got.first_against_cpu;
  EXPECT_EQ(got.against_search, 0u) << "against the search, first at bits 0x" << std::hex << got.first_against_search;
}

TEST(BlockwiseCodecs, TheEightBitEncodesCountAsTheCpuEncodeOnEveryF32) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const spec::QuantTables& t = spec::quant_tables();
  expect_every_f32_counts_as_the_cpu_encode<spec::QuantTable, true>(t.table[0]);
  expect_every_f32_counts_as_the_cpu_encode<spec::QuantTable, false>(t.table[1]);
}

TEST(BlockwiseCodecs, TheFourBitEncodesCountAsTheCpuEncodeOnEveryF32) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const spec::QuantTables4& t = spec::quant_tables4();
  expect_every_f32_counts_as_the_cpu_encode<spec::QuantTable4, true>(t.table[0]);
  expect_every_f32_counts_as_the_cpu_encode<spec::QuantTable4, false>(t.table[1]);
}

}  // namespace
