// Reductions over a block and a warp in a fixed order (shuffle trees, then
// warps in index order), so that a result is bitwise the same on every run:
// no atomics, no order that depends on scheduling.
#pragma once

namespace gradkit::cuda {

template <class T, class Combine>
__device__ __forceinline__ T warp_reduce(T value, Combine combine) {
  for (int offset = 16; offset > 0; offset /= 2) value = combine(value, __shfl_down_sync(0xffffffffu, value, offset));
  return value;
}

// The combination of every thread's value; valid in thread 0 only. Every
// thread of the block must call it (it synchronizes), with blockDim.x a
// multiple of 32 and at most 1024.
template <class T, class Combine>
__device__ __forceinline__ T block_reduce(T value, Combine combine) {
  __shared__ T per_warp[32];
  value = warp_reduce(value, combine);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // per_warp may still be read by an earlier call
  if (lane == 0) per_warp[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    value = per_warp[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) value = combine(value, per_warp[w]);
  }
  return value;
}

struct Plus {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};

}  // namespace gradkit::cuda
