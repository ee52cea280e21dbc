// What the kernels over 8-bit and 4-bit moments share (cuda/adam_low_bit.cu,
// cuda/lamb_low_bit.cu): a warp owns one quantization block at a time, lane k
// the kPerLane consecutive elements from k * kPerLane; the code tables are
// copied into shared memory once per thread block.
#pragma once

#include <cstdint>

#include "backend/blockwise_math.h"
#include "cuda/multi_tensor.cuh"

namespace gradkit::cuda {

constexpr int kLanes = 32;
constexpr int kPerLane = kQuantBlock / kLanes;  // 8
static_assert(kQuantBlock % kLanes == 0 && kPerLane >= 1 && kPerLane <= 16);

// kPerLane consecutive elements from p (n of them valid), one vector load
// when the block is whole and the address allows it.
template <class T>
__device__ __forceinline__ void load_lane(T (&dst)[kPerLane], const T* p, int n, bool vectorized) {
  if (vectorized && n == kPerLane) return load<kPerLane>(dst, p, true);
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) dst[k] = k < n ? p[k] : T{};
}

template <class T>
__device__ __forceinline__ void store_lane(T* p, const T (&src)[kPerLane], int n, bool vectorized) {
  if (vectorized && n == kPerLane) return store<kPerLane>(p, src, true);
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (k < n) p[k] = src[k];
  }
}

// Asks L2 for the line that holds p, ahead of the load that will read it:
// no register waits for it, so a warp can have its next block's lines on
// their way from DRAM while it computes this one (the low-bit ops' register
// budgets, 64 or 80 a thread, leave no room to load them into registers
// early).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Calls body(b, at, n) for each quantization block b of a chunk of `length`
// elements that this thread's warp owns (warp w: blocks w, w + warps, ...):
// `at` is the lane's first element, `n` how many of its kPerLane elements
// lie in the chunk (0 to kPerLane). Every lane of the warp calls body for the
// same blocks, so body may use the warp's shuffles. With `ahead` > 0, it
// first calls prefetch(at') with the lane's first element `ahead` blocks of
// this warp later, when that lies in the chunk.
template <class Prefetch, class Body>
__device__ __forceinline__ void for_each_warp_block(int length, int ahead, Prefetch&& prefetch, Body&& body) {
  const int lane = threadIdx.x % kLanes, warps = blockDim.x / kLanes;
  const int blocks = (length + kQuantBlock - 1) / kQuantBlock;
  for (int b = threadIdx.x / kLanes; b < blocks; b += warps) {
    const int at = b * kQuantBlock + lane * kPerLane;
    const int later = at + ahead * warps * kQuantBlock;
    if (ahead > 0 && later < length) prefetch(later);
    body(b, at, min(kPerLane, max(0, length - at)));
  }
}

template <class Body>
__device__ __forceinline__ void for_each_warp_block(int length, Body&& body) {
  for_each_warp_block(length, 0, [](int) {}, body);
}

// Copies a form's tables (backend::QuantTables, QuantTables4) into `to`
// (shared memory) with the block's threads; the caller synchronizes before
// reading them.
template <class Tables>
__device__ __forceinline__ void copy_tables(Tables& to, const Tables* from) {
  static_assert(sizeof(Tables) % sizeof(float) == 0);
  const auto* src = reinterpret_cast<const float*>(from);
  auto* dst = reinterpret_cast<float*>(&to);
  for (int k = threadIdx.x; k < static_cast<int>(sizeof(Tables) / sizeof(float)); k += blockDim.x) dst[k] = src[k];
}

}  // namespace gradkit::cuda
