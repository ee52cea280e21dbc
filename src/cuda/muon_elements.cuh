// Muon's element kernels on CUDA, as functors of the multi-tensor driver
// (cuda/multi_tensor.cuh): the momentum pass with each chunk's sum of
// squares, a sharded plan's assembly and dispersal of the ranks' rows, the
// normalisation and the weight update. Included by cuda/muon.cu, which runs
// them around its products.
#pragma once

#include <cstdint>

#include "spec/muon.h"
#include "spec/muon_math.h"
#include "cuda/block_reduce.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::spec::muon_cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Each pass goes in groups of kGroup consecutive elements a thread, one
// vector load or store of each tensor a group where every address allows it
// (8 bf16 values are 16 bytes; an f32 tensor takes two), kUnroll groups per
// thread in flight (cuda/multi_tensor.cuh, for_each_group), as the other
// element kernels do; one element at a time (four in flight) is slower
// (measured: bench/log/2026-11-27.md, "Muon's element passes in vector
// groups").
constexpr int kGroup = 8;
constexpr int kUnroll = 2;

// A chunk's sum of the squares of its bf16 values: each thread adds its
// values in the order for_each_group gives them, then the block's tree,
// written as the chunk's partial. The momentum pass and the sharded plan's
// assembly add the same values in the same groups, chunks and threads, so
// a matrix's norm is the same bits either way.
struct SumOfSquares {
  float sum = 0.0f;
  __device__ __forceinline__ void add(bf16 v) {
    const float f = __bfloat162float(v);
    sum = __fadd_rn(sum, __fmul_rn(f, f));
  }
  __device__ __forceinline__ void add(const bf16 (&v)[kGroup]) {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) add(v[k]);
  }
  __device__ __forceinline__ void write(float* partials) {
    const float total = cuda::block_reduce(sum, cuda::Plus{});
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
  }
};

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
    // To the batch's matrices with the chunk's sum of squares, or (x null)
    // to the rows' places in the exchange buffer (no sum).
    bf16* out = x != nullptr ? x + chunk.tensor * elements + chunk.begin : plan.tensor<bf16>(3, chunk);
    const bool vectorized =
        cuda::vector_aligned<kGroup>(grad) && cuda::vector_aligned<kGroup>(buffer) && cuda::vector_aligned<kGroup>(out);
    SumOfSquares sum;
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
            if (x != nullptr) sum.add(xr[u]);
          }
        },
        [&](int j) {
          NM b = buffer[j];
          const bf16 xb = element(grad[j], b);
          buffer[j] = b;
          out[j] = xb;
          if (x != nullptr) sum.add(xb);
        });
    if (x == nullptr) return;
    sum.write(partials);
  }
};

// Where each element of an owned matrix lies in the exchange buffer: in the
// piece of the rank that holds it (MuonPiece). A thread's elements go up, so
// the piece found for one is where the search for the next begins.
struct PieceFinder {
  const MuonPiece* pieces;
  int32_t ranks;
  bool by_rows;
  int64_t cols;
  int32_t s = 0;

  __device__ __forceinline__ int64_t operator()(int64_t e) {
    if (by_rows) {  // no division: the pieces are whole rows in order
      s = row_piece_holding(pieces, ranks, s, e, cols);
      return pieces[s].at + e - pieces[s].row * cols;
    }
    const int64_t i = e / cols, j = e - i * cols;
    s = piece_holding(pieces, ranks, s, i, j);
    return piece_element(pieces[s], i, j);
  }
};

// A sharded plan's owned matrices from the ranks' pieces in the exchange
// buffer, with each chunk's sum of squares in the momentum pass's order
// (the same chunks, threads and reduction: the same norm, bit for bit).
struct AssembleOp {
  const MuonPiece* pieces;  // ranks per matrix
  int32_t ranks;
  bool by_rows;
  const bf16* exchange;
  bf16* x;
  float* partials;
  int64_t elements, cols;
  const bool* found_inf;

  __device__ void operator()(const cuda::PlanArgs&, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    PieceFinder at{pieces + static_cast<int64_t>(chunk.tensor) * ranks, ranks, by_rows, cols};
    bf16* out = x + chunk.tensor * elements + chunk.begin;
    SumOfSquares sum;
    const auto gather = [&](int64_t e) { return exchange[at(e)]; };
    // The momentum pass's groups and order (a piece may begin anywhere, so
    // the loads are one element each; the stores are vectors).
    cuda::for_each_group<kGroup, kUnroll>(
        chunk.length, cuda::vector_aligned<kGroup>(out),
        [&]<int U>(int i, int stride, bool vec) {
          bf16 v[U][kGroup];
#pragma unroll
          for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int k = 0; k < kGroup; ++k) v[u][k] = gather(chunk.begin + i + u * stride + k);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            cuda::store<kGroup>(out + i + u * stride, v[u], vec);
            sum.add(v[u]);
          }
        },
        [&](int j) {
          const bf16 xb = gather(chunk.begin + j);
          out[j] = xb;
          sum.add(xb);
        });
    sum.write(partials);
  }
};

// The orthogonalised matrices' pieces back where each rank's came from.
struct DisperseOp {
  const MuonPiece* pieces;
  int32_t ranks;
  bool by_rows;
  bf16* exchange;
  const bf16* result;
  int64_t elements, cols;
  const bool* found_inf;

  __device__ void operator()(const cuda::PlanArgs&, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    PieceFinder at{pieces + static_cast<int64_t>(chunk.tensor) * ranks, ranks, by_rows, cols};
    const bf16* in = result + chunk.tensor * elements + chunk.begin;
    const auto scatter = [&](int64_t e, bf16 value) { exchange[at(e)] = value; };
    cuda::for_each_value<kGroup, kUnroll>(chunk.length, in, cuda::vector_aligned<kGroup>(in), false,
                                          [&](int i, bf16 value) { scatter(chunk.begin + i, value); });
  }
};

// A matrix's sum of squares: its chunks' partials added in chunk order by
// every thread, the same sum in every block of the matrix, without a pass
// of its own.
__device__ __forceinline__ double matrix_sum(const cuda::PlanArgs& plan, const float* partials, int64_t tensor) {
  const int64_t first = plan.first_chunk(tensor), last = plan.first_chunk(tensor + 1);
  double sum = 0.0;
  for (int64_t k = first; k < last; ++k) sum += partials[k];
  return sum;
}

// MuonEq on the batch's matrices, a block per chunk as the other passes
// (so that its partials take the chunks' places): each block takes the
// matrix's rows [R k / n, R (k + 1) / n) for its chunk k of n, a warp a row
// (a row's sum is a warp's tree: no block-wide wait per row), and per row
// the sum of squares, the scale from the matrix's norm (its momentum
// partials, in chunk order as NormaliseOp adds them) and the scaled bf16
// values written back; the block's sum of their squares goes to `scaled`,
// at the chunk's place.
struct EquilibrateOp {
  bf16* x;
  const float* partials;
  float* scaled;
  int64_t rows, cols, elements;
  const bool* found_inf;

  __device__ void operator()(const cuda::PlanArgs& plan, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    const int64_t first = plan.first_chunk(chunk.tensor), last = plan.first_chunk(chunk.tensor + 1);
    const float target = muon_row_target(matrix_sum(plan, partials, chunk.tensor), rows);
    const int64_t part = blockIdx.x - first, parts = last - first;
    const int64_t row_begin = rows * part / parts, row_end = rows * (part + 1) / parts;
    const int lane = static_cast<int>(threadIdx.x % 32), warps = static_cast<int>(blockDim.x / 32);
    bf16* matrix = x + chunk.tensor * elements;
    float total = 0.0f;
    for (int64_t r = row_begin + threadIdx.x / 32; r < row_end; r += warps) {
      bf16* row = matrix + r * cols;
      float squares = 0.0f;
      for (int64_t j = lane; j < cols; j += 32) {
        const float v = __bfloat162float(row[j]);
        squares = __fadd_rn(squares, __fmul_rn(v, v));
      }
      squares = __shfl_sync(0xffffffffu, cuda::warp_reduce(squares, cuda::Plus{}), 0);
      const float scale = round_bf16(muon_row_scale(target, squares));
      for (int64_t j = lane; j < cols; j += 32) {
        const bf16 v = __float2bfloat16_rn(__fmul_rn(__bfloat162float(row[j]), scale));
        row[j] = v;
        const float f = __bfloat162float(v);
        total = __fadd_rn(total, __fmul_rn(f, f));
      }
    }
    total = cuda::block_reduce(total, cuda::Plus{});
    if (threadIdx.x == 0) scaled[blockIdx.x] = total;
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
    const float divisor = muon_divisor(matrix_sum(plan, partials, chunk.tensor), hyper->eps, round_bf16, hyper->divisor);
    bf16* out = x + chunk.tensor * elements + chunk.begin;
    const auto divided = [divisor](bf16 v) { return __float2bfloat16_rn(__fdiv_rn(__bfloat162float(v), divisor)); };
    cuda::for_each_value<kGroup, kUnroll>(chunk.length, out, cuda::vector_aligned<kGroup>(out), true,
                                          [&](int, bf16& v) { v = divided(v); });
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
  // Muon+ and NorMuon (ResultScales): per matrix, max(rows, cols) line
  // factors and the Muon+ factor; null where the step does not scale.
  const float* lines = nullptr;
  const float* factors = nullptr;

  __device__ void operator()(const cuda::PlanArgs& plan, const PlanChunk& chunk) const {
    if (found_inf != nullptr && *found_inf) return;
    using NP = cuda::native_t<P>;
    const MuonCoefficients c = muon_coefficients(*hyper, rows, cols);
    NP* param = plan.tensor<NP>(0, chunk);
    const bf16* o = orthogonal != nullptr ? orthogonal + chunk.tensor * elements + chunk.begin
                                          : plan.tensor<const bf16>(3, chunk);
    const auto round_weight = [](float v) { return cuda::to_compute<float>(cuda::from_compute<NP>(v)); };
    // The element's update: the result, scaled by its matrix's and its
    // line's factors where the step has them (e: its index in the matrix).
    const float* line = lines != nullptr ? lines + chunk.tensor * (rows >= cols ? rows : cols) : nullptr;
    const float f = lines != nullptr ? factors[chunk.tensor] : 1.0f;
    const bool per_row = muon_per_row(rows, cols);
    const auto updated = [&](NP w, bf16 u, int i) {
      float o_value = __bfloat162float(u);
      if (line != nullptr) {
        const auto e = static_cast<uint64_t>(chunk.begin + i), n = static_cast<uint64_t>(cols);
        const uint64_t at = e <= 0xffffffffu ? (per_row ? static_cast<uint32_t>(e) / static_cast<uint32_t>(n)
                                                        : static_cast<uint32_t>(e) % static_cast<uint32_t>(n))
                                             : (per_row ? e / n : e % n);
        o_value = muon_scaled(o_value, f, line[at], round_weight);
      }
      return cuda::from_compute<NP>(muon_weight(cuda::to_compute<float>(w), o_value, c, round_weight));
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
            for (int k = 0; k < kGroup; ++k) pr[u][k] = updated(pr[u][k], orr[u][k], i + u * stride + k);
            cuda::store<kGroup>(param + i + u * stride, pr[u], vec);
          }
        },
        [&](int j) { param[j] = updated(param[j], o[j], j); });
  }
};

// Muon+ and NorMuon after Newton-Schulz: each matrix's sums of squares
// along its lines (rows where rows >= cols, else columns) into `lines`,
// then one block a matrix turns them into the line factors and the Muon+
// factor (spec::muon_scales), updating the second moment.
__global__ void line_sums_kernel(const bf16* result, float* lines, int64_t rows, int64_t cols, const bool* found_inf) {
  if (found_inf != nullptr && *found_inf) return;
  const int64_t m = blockIdx.y, length = rows >= cols ? rows : cols;
  const bf16* o = result + m * rows * cols;
  float* out = lines + m * length;
  if (muon_per_row(rows, cols)) {  // a warp per row, its lanes along the row
    const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;
    float sum = 0.0f;
    for (int64_t j = threadIdx.x % 32; j < cols; j += 32) {
      const float v = __bfloat162float(o[r * cols + j]);
      sum = __fadd_rn(sum, __fmul_rn(v, v));
    }
    sum = cuda::warp_reduce(sum, cuda::Plus{});
    if (threadIdx.x % 32 == 0) out[r] = sum;
  } else {  // a thread per column, down the rows (the block's loads coalesce along a row)
    const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float v = __bfloat162float(o[r * cols + j]);
      sum = __fadd_rn(sum, __fmul_rn(v, v));
    }
    out[j] = sum;
  }
}

__global__ void result_scales_kernel(const MuonHyperparameters* hyper, float* lines, float* factors,
                                     float* const* second_moment, int64_t rows, int64_t cols, const bool* found_inf) {
  if (found_inf != nullptr && *found_inf) return;
  __shared__ float total;
  const int64_t m = blockIdx.x, length = rows >= cols ? rows : cols;
  float* sums = lines + m * length;
  float* second = second_moment != nullptr ? second_moment[m] : nullptr;
  // The sum over all lines of value(i): each thread's lines in order, then the block's tree.
  const auto reduce = [&](auto value) {
    float t = 0.0f;
    for (int64_t i = threadIdx.x; i < length; i += blockDim.x) t = __fadd_rn(t, value(i));
    t = cuda::block_reduce(t, cuda::Plus{});
    if (threadIdx.x == 0) total = t;
    __syncthreads();
    const float all = total;
    __syncthreads();
    return all;
  };
  const float f = muon_scales(*hyper, rows, cols, sums, second, reduce, threadIdx.x, blockDim.x);
  if (threadIdx.x == 0) factors[m] = f;
}

}  // namespace gradkit::spec::muon_cuda
