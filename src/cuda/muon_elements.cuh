// Muon's element kernels on CUDA, as functors of the multi-tensor driver
// (cuda/multi_tensor.cuh): the momentum pass with each chunk's sum of
// squares, a sharded plan's assembly and dispersal of the ranks' rows, the
// normalisation and the weight update. Included by cuda/muon.cu, which runs
// them around its products.
#pragma once

#include <cstdint>

#include "backend/muon.h"
#include "backend/muon_math.h"
#include "cuda/block_reduce.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::backend::muon_cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Elements per thread whose loads are in flight together (the passes with a
// running sum, whose order is fixed).
constexpr int kInFlight = 4;

// The passes without a sum go in groups of kGroup consecutive elements, one
// vector load or store of each tensor a group where every address allows it
// (8 bf16 values are 16 bytes; an f32 tensor takes two), kUnroll groups per
// thread in flight (cuda/multi_tensor.cuh, for_each_group), as the other
// element kernels do. One element at a time, the GPT-2 list's update ran at
// about 60% of copy bandwidth (bench/RESULTS.md, 2026-11-27).
constexpr int kGroup = 8;
constexpr int kUnroll = 2;

// Runs use(i, load(i)) for the chunk's elements i = threadIdx.x, +blockDim.x,
// ... in that order, each thread's next kInFlight loads issued before any of
// their uses. The kernels' pointers may alias (nothing says otherwise), so
// the compiler cannot hoist a load above the previous element's store by
// itself; one element at a time leaves too few loads in flight to reach the
// memory's bandwidth. Each thread still meets its elements in the order of
// the plain strided loop, so its running sums (the norms) are the same bits.
template <class Load, class Use>
__device__ __forceinline__ void for_each_element(int32_t length, Load&& load, Use&& use) {
  using Loaded = decltype(load(int32_t{0}));
  const int32_t step = static_cast<int32_t>(blockDim.x);
  int32_t i = static_cast<int32_t>(threadIdx.x);
  for (; i + (kInFlight - 1) * step < length; i += kInFlight * step) {
    Loaded v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) v[k] = load(i + k * step);
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) use(i + k * step, v[k]);
  }
  for (; i < length; i += step) use(i, load(i));
}

// The momentum pass: the buffers, and the Newton-Schulz input rounded to
// bf16, to the batch's matrices with each chunk's sum of squares, or
// (x null) to the rows' places in the exchange buffer, the plan's list 3.
template <class P, class G, class M>
struct MomentumOp {
  // Two blocks a multiprocessor (64 registers): the vector groups' registers
  // would otherwise leave room for one.
  static constexpr int kMinBlocks = 2;
  const MuonHyperparameters* hyper;  // the group's entry of the plan's table (on the device)
  int64_t rows, cols;
  bf16* x;          // the batch's matrices, one after another (or null: list 3)
  float* partials;  // one per chunk
  int64_t elements; // per matrix
  const bool* found_inf;
  float grad_scale;
  const float* grad_scale_device;

  __device__ void operator()(const cuda::PlanArgs& plan, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    const float scale = grad_scale_device != nullptr ? *grad_scale_device : grad_scale;
    const MuonCoefficients c = muon_coefficients(*hyper, rows, cols);
    using NG = cuda::native_t<G>;
    using NM = cuda::native_t<M>;
    const NG* grad = plan.tensor<NG>(1, chunk);
    NM* buffer = plan.tensor<NM>(2, chunk);
    // One element's pass: the buffer stored, and the Newton-Schulz input (bf16).
    const auto element = [&](NG grad_in, NM& buffer_in_out) {
      const float g = __fdiv_rn(cuda::to_compute<float>(grad_in), scale);
      const NM stored = cuda::from_compute<NM>(muon_momentum(g, cuda::to_compute<float>(buffer_in_out), c));
      buffer_in_out = stored;
      const float s = cuda::to_compute<float>(stored);
      const float u = c.nesterov ? cuda::to_compute<float>(cuda::from_compute<NG>(muon_nesterov(g, s, c))) : s;
      return __float2bfloat16_rn(u);
    };
    if (x == nullptr) {
      // The rows to the exchange buffer: no sum, so the elements may go in
      // vector groups (the order of the sums below is the assembly's too).
      bf16* out = plan.tensor<bf16>(3, chunk);
      const bool vectorized = cuda::vector_aligned<kGroup>(grad) && cuda::vector_aligned<kGroup>(buffer) &&
                              cuda::vector_aligned<kGroup>(out);
      cuda::for_each_group<kGroup, kUnroll>(
          chunk.length, vectorized,
          [&]<int U>(int i, int stride, bool vec) {
            NG gr[U][kGroup];
            NM br[U][kGroup];
            bf16 xr[U][kGroup];
#pragma unroll
            for (int u = 0; u < U; ++u) {
              cuda::load<kGroup>(gr[u], grad + i + u * stride, vec);
              cuda::load<kGroup>(br[u], buffer + i + u * stride, vec);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
              for (int k = 0; k < kGroup; ++k) xr[u][k] = element(gr[u][k], br[u][k]);
              cuda::store<kGroup>(buffer + i + u * stride, br[u], vec);
              cuda::store<kGroup>(out + i + u * stride, xr[u], vec);
            }
          },
          [&](int j) {
            NM b = buffer[j];
            out[j] = element(grad[j], b);
            buffer[j] = b;
          });
      return;
    }
    bf16* out = x + chunk.tensor * elements + chunk.begin;
    float sum = 0.0f;
    struct Loaded {
      NG grad;
      NM buffer;
    };
    for_each_element(
        chunk.length, [&](int32_t i) { return Loaded{grad[i], buffer[i]}; },
        [&](int32_t i, const Loaded& in) {
          NM b = in.buffer;
          const bf16 xb = element(in.grad, b);
          buffer[i] = b;
          out[i] = xb;
          const float xf = __bfloat162float(xb);
          sum = __fadd_rn(sum, __fmul_rn(xf, xf));
        });
    sum = cuda::block_reduce(sum, cuda::Plus{});
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
  }
};

// An owned matrix's element comes from the rank whose rows hold it: the
// last piece that begins at or before it. Each thread's elements go up, so
// its piece only moves on.
__device__ __forceinline__ int32_t next_piece(const MuonPiece* pieces, int32_t ranks, int32_t s, int64_t element) {
  while (s + 1 < ranks && element >= pieces[s + 1].first) ++s;
  return s;
}

// A sharded plan's owned matrices from the ranks' rows in the exchange
// buffer, with each chunk's sum of squares in the momentum pass's order
// (the same chunks, threads and reduction: the same norm, bit for bit).
struct AssembleOp {
  const MuonPiece* pieces;  // ranks per matrix
  int32_t ranks;
  const bf16* exchange;
  bf16* x;
  float* partials;
  int64_t elements;
  const bool* found_inf;

  __device__ void operator()(const cuda::PlanArgs&, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    const MuonPiece* p = pieces + static_cast<int64_t>(chunk.tensor) * ranks;
    bf16* out = x + chunk.tensor * elements + chunk.begin;
    float sum = 0.0f;
    int32_t s = 0;  // the loads meet the elements in order, so the piece only moves on
    for_each_element(
        chunk.length,
        [&](int32_t i) {
          const int64_t e = chunk.begin + i;
          s = next_piece(p, ranks, s, e);
          return exchange[p[s].at + e - p[s].first];
        },
        [&](int32_t i, bf16 xb) {
          out[i] = xb;
          const float xf = __bfloat162float(xb);
          sum = __fadd_rn(sum, __fmul_rn(xf, xf));
        });
    sum = cuda::block_reduce(sum, cuda::Plus{});
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
  }
};

// The orthogonalised matrices' rows back where each rank's came from.
struct DisperseOp {
  const MuonPiece* pieces;
  int32_t ranks;
  bf16* exchange;
  const bf16* result;
  int64_t elements;
  const bool* found_inf;

  __device__ void operator()(const cuda::PlanArgs&, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    const MuonPiece* p = pieces + static_cast<int64_t>(chunk.tensor) * ranks;
    const bf16* in = result + chunk.tensor * elements + chunk.begin;
    int32_t s = 0;
    for_each_element(
        chunk.length, [&](int32_t i) { return in[i]; },
        [&](int32_t i, bf16 value) {
          const int64_t e = chunk.begin + i;
          s = next_piece(p, ranks, s, e);
          exchange[p[s].at + e - p[s].first] = value;
        });
  }
};

struct NormaliseOp {
  const MuonHyperparameters* hyper;
  bf16* x;
  const float* partials;
  int64_t elements;
  const bool* found_inf;

  __device__ void operator()(const cuda::PlanArgs& plan, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    // Every thread adds the matrix's partials in chunk order: the same sum
    // in every block of the matrix, without a pass of its own.
    const int64_t first = plan.first_chunk(chunk.tensor), last = plan.first_chunk(chunk.tensor + 1);
    double sum = 0.0;
    for (int64_t k = first; k < last; ++k) sum += partials[k];
    const float divisor = muon_divisor(sum, hyper->eps, round_bf16);
    bf16* out = x + chunk.tensor * elements + chunk.begin;
    const auto divided = [divisor](bf16 v) { return __float2bfloat16_rn(__fdiv_rn(__bfloat162float(v), divisor)); };
    cuda::for_each_group<kGroup, kUnroll>(
        chunk.length, cuda::vector_aligned<kGroup>(out),
        [&]<int U>(int i, int stride, bool vec) {
          bf16 v[U][kGroup];
#pragma unroll
          for (int u = 0; u < U; ++u) cuda::load<kGroup>(v[u], out + i + u * stride, vec);
#pragma unroll
          for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int k = 0; k < kGroup; ++k) v[u][k] = divided(v[u][k]);
            cuda::store<kGroup>(out + i + u * stride, v[u], vec);
          }
        },
        [&](int j) { out[j] = divided(out[j]); });
  }
};

// The weight update from the orthogonalised matrices, or (orthogonal null)
// from the rows' places in the exchange buffer, the plan's list 3.
template <class P>
struct WeightOp {
  const MuonHyperparameters* hyper;
  int64_t rows, cols;
  const bf16* orthogonal;
  int64_t elements;
  const bool* found_inf;

  __device__ void operator()(const cuda::PlanArgs& plan, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    using NP = cuda::native_t<P>;
    const MuonCoefficients c = muon_coefficients(*hyper, rows, cols);
    NP* param = plan.tensor<NP>(0, chunk);
    const bf16* o = orthogonal != nullptr ? orthogonal + chunk.tensor * elements + chunk.begin
                                          : plan.tensor<const bf16>(3, chunk);
    const auto round_weight = [](float v) { return cuda::to_compute<float>(cuda::from_compute<NP>(v)); };
    const auto updated = [&](NP w, bf16 u) {
      return cuda::from_compute<NP>(muon_weight(cuda::to_compute<float>(w), __bfloat162float(u), c, round_weight));
    };
    cuda::for_each_group<kGroup, kUnroll>(
        chunk.length, cuda::vector_aligned<kGroup>(param) && cuda::vector_aligned<kGroup>(o),
        [&]<int U>(int i, int stride, bool vec) {
          NP pr[U][kGroup];
          bf16 orr[U][kGroup];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            cuda::load<kGroup>(pr[u], param + i + u * stride, vec);
            cuda::load<kGroup>(orr[u], o + i + u * stride, vec);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int k = 0; k < kGroup; ++k) pr[u][k] = updated(pr[u][k], orr[u][k]);
            cuda::store<kGroup>(param + i + u * stride, pr[u], vec);
          }
        },
        [&](int j) { param[j] = updated(param[j], o[j]); });
  }
};

}  // namespace gradkit::backend::muon_cuda
