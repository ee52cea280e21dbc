// The one generic multi-tensor driver: a kernel that walks a plan's chunk
// table and hands each chunk to a small functor, plus the vectorized loop
// the functors share.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/check.h"
#include "gradkit/core/multi_tensor_plan.h"

namespace gradkit::cuda {

// What a kernel needs of a plan: two device pointers and two counts.
struct PlanArgs {
  const PlanChunk* chunks;
  void* const* pointers;  // list-major: tensor t of list l at pointers[l * num_tensors + t]
  const int32_t* groups;  // parameter group of each tensor
  int64_t num_tensors;
  int64_t num_chunks;

  template <class T>
  __device__ __forceinline__ T* tensor(int list, const PlanChunk& c) const {
    return static_cast<T*>(pointers[list * num_tensors + c.tensor]) + c.begin;
  }
  // The chunk's part of a list of per-block values (PlanList::block).
  template <class T>
  __device__ __forceinline__ T* block_tensor(int list, const PlanChunk& c, int32_t block) const {
    return static_cast<T*>(pointers[list * num_tensors + c.tensor]) + c.begin / block;
  }

  // The index of the first chunk of tensor `t` (chunks are stored in tensor
  // order), or of the first chunk after it if it has none.
  __device__ int64_t first_chunk(int64_t t) const {
    int64_t lo = 0, hi = num_chunks;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (chunks[mid].tensor < t) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
};

inline PlanArgs plan_args(const MultiTensorPlan& plan) {
  const auto* table = static_cast<const unsigned char*>(plan.device_table());
  const auto num_chunks = static_cast<int64_t>(plan.chunks().size());
  const size_t pointers_at = num_chunks * sizeof(PlanChunk);
  const size_t groups_at = pointers_at + plan.pointers().size() * sizeof(void*);
  return PlanArgs{reinterpret_cast<const PlanChunk*>(table), reinterpret_cast<void* const*>(table + pointers_at),
                  reinterpret_cast<const int32_t*>(table + groups_at), static_cast<int64_t>(plan.num_tensors()),
                  num_chunks};
}

inline constexpr int kBlockThreads = 512;

// Threads of an op's blocks (Op::kBlockThreads, default 512). With
// Op::kMinBlocks below they set the op's register budget, 65536 /
// (threads * blocks) rounded down to a multiple of 8: 512 threads allow only
// 64 (two blocks) or 128 (one), so an op that needs between the two picks a
// smaller block.
template <class Op>
constexpr int block_threads() {
  if constexpr (requires { Op::kBlockThreads; }) {
    static_assert(Op::kBlockThreads % 32 == 0 && Op::kBlockThreads <= 1024, "whole warps, at most 1024 threads");
    return Op::kBlockThreads;
  }
  return kBlockThreads;
}

// Blocks an op asks to keep resident per multiprocessor (Op::kMinBlocks,
// default 1): the compiler then holds its registers to fit them.
template <class Op>
constexpr int min_blocks() {
  if constexpr (requires { Op::kMinBlocks; }) return Op::kMinBlocks;
  return 1;
}

// Blocks an op asks to share each chunk (Op::kChunkParts, default 1): part
// p of a chunk is its p-th run of whole Op::kPartAlign-element pieces. More
// blocks of less work each shorten the launch's tail, where the last blocks
// run with the multiprocessors half idle; an op whose blocks write per-chunk
// results (LAMB's partial sums, indexed by blockIdx.x) keeps one.
template <class Op>
constexpr int chunk_parts() {
  if constexpr (requires { Op::kChunkParts; }) {
    static_assert(Op::kChunkParts == 1 || Op::kPartAlign > 0, "parts of whole pieces");
    return Op::kChunkParts;
  }
  return 1;
}

// One block per chunk (or per part of one): a chunk is at most 64K
// elements, so a block (512 threads for most ops) makes a handful of passes
// over it, and small tensors still yield many blocks for the scheduler to
// spread over the multiprocessors. As many blocks as the GPU holds, each
// with an even share of the plan's elements (no tail of half-empty
// multiprocessors), is slower for the low-bit Adam kernels (measured:
// bench/log/2026-11-28.md, "an even share a resident block").
template <class Op>
__global__ void __launch_bounds__(block_threads<Op>(), min_blocks<Op>()) multi_tensor_kernel(PlanArgs plan, Op op) {
  constexpr int parts = chunk_parts<Op>();
  if constexpr (parts == 1) {
    op(plan, plan.chunks[blockIdx.x]);
  } else {
    PlanChunk chunk = plan.chunks[blockIdx.x / parts];
    constexpr int align = Op::kPartAlign;
    const int part_length = ((chunk.length + parts - 1) / parts + align - 1) / align * align;
    const int begin = static_cast<int>(blockIdx.x % parts) * part_length;
    if (begin >= chunk.length) return;  // a short chunk has fewer parts
    chunk.begin += begin;
    chunk.length = min(part_length, chunk.length - begin);
    op(plan, chunk);
  }
}

template <class Op>
void launch_multi_tensor(const MultiTensorPlan& plan, const Op& op, Stream stream) {
  if (plan.empty()) return;
  DeviceGuard guard(plan.device().index);
  const PlanArgs args = plan_args(plan);
  // Grid x allows 2^31 - 1 blocks: a plan of 64K-element chunks reaches that
  // only past 10^14 / chunk_parts elements.
  multi_tensor_kernel<<<static_cast<unsigned>(args.num_chunks * chunk_parts<Op>()), block_threads<Op>(), 0,
                        native(stream)>>>(args, op);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

// Whether the N-element vectors starting at p (and every multiple of N
// elements after it) are aligned for one N * sizeof(T)-byte access.
template <int N, class T>
__device__ __forceinline__ bool vector_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (N * sizeof(T)) == 0;
}

template <class T, int N>
struct alignas(sizeof(T) * N) Vector {
  T v[N];
};

template <int N, class T>
__device__ __forceinline__ void load(T (&dst)[N], const T* src, bool vectorized) {
  if (vectorized) {
    const auto vec = *reinterpret_cast<const Vector<T, N>*>(src);
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = vec.v[k];
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = src[k];
  }
}

template <int N, class T>
__device__ __forceinline__ void store(T* dst, const T (&src)[N], bool vectorized) {
  if (vectorized) {
    Vector<T, N> vec;
#pragma unroll
    for (int k = 0; k < N; ++k) vec.v[k] = src[k];
    *reinterpret_cast<Vector<T, N>*>(dst) = vec;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = src[k];
  }
}

// Runs body(i, vectorized) for i = 0, N, 2N, ... below the chunk's last full
// N-element group, spread over the block, `kUnroll` groups per thread per
// step so that several independent loads are in flight; then body_tail(i)
// for each element past the last full group. `body` loads, computes and
// stores one group; its loads for the kUnroll groups of a step are issued
// before their stores because the body is inlined and the groups are
// independent.
template <int N, int kUnroll, class Body, class Tail>
__device__ __forceinline__ void for_each_group(int length, bool vectorized, Body&& body, Tail&& body_tail) {
  const int full = length - length % N;
  const int stride = blockDim.x * N;
  int i = threadIdx.x * N;
  for (; i + (kUnroll - 1) * stride < full; i += kUnroll * stride) {
    body.template operator()<kUnroll>(i, stride, vectorized);
  }
  for (; i < full; i += stride) body.template operator()<1>(i, stride, vectorized);
  for (int j = full + threadIdx.x; j < length; j += blockDim.x) body_tail(j);
}

// for_each_group over one tensor: loads each N-element group of p (kUnroll
// groups in flight a thread), calls f(i, value) on each of its values in
// element order (i counted from p), and stores the group back when `write`
// (never for a const p); past the last full group, element by element.
// What a pass that reads one tensor, and may rewrite it, needs.
template <int N, int kUnroll, class T, class F>
__device__ __forceinline__ void for_each_value(int length, T* p, bool vectorized, bool write, F&& f) {
  using V = std::remove_const_t<T>;
  for_each_group<N, kUnroll>(
      length, vectorized,
      [&]<int U>(int i, int stride, bool vec) {
        V v[U][N];
#pragma unroll
        for (int u = 0; u < U; ++u) load<N>(v[u], p + i + u * stride, vec);
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int k = 0; k < N; ++k) f(i + u * stride + k, v[u][k]);
          if constexpr (!std::is_const_v<T>) {
            if (write) store<N>(p + i + u * stride, v[u], vec);
          }
        }
      },
      [&](int j) {
        V x = p[j];
        f(j, x);
        if constexpr (!std::is_const_v<T>) {
          if (write) p[j] = x;
        }
      });
}

}  // namespace gradkit::cuda
