// What the kernels over 8-bit and 4-bit moments share (cuda/adam_low_bit.cu,
// cuda/lamb_low_bit.cu): a warp owns one quantization block at a time, lane k
// the kPerLane consecutive elements from k * kPerLane; the code tables are
// copied into shared memory once per thread block.
#pragma once

#include <cstdint>
#include <type_traits>

#include "backend/blockwise_math.h"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

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

// A lane's kPerLane values of kBits each (4-bit or 8-bit codes, bf16 bits,
// 16-bit remainders) as the 32-bit words that hold them in memory, value k
// at bit (k % kPerWord) * kBits of word k / kPerWord. One vector load fills
// them and each value is taken out where it is used: held as an array of
// bytes or halves, they took a register each, unpacked on load and masked
// again at use (3.5 instructions a code on the 8-bit path), and were masked
// and shifted back into bytes to be stored.
template <int kBits>
struct LaneBits {
  static_assert(kBits == 4 || kBits == 8 || kBits == 16);
  static constexpr int kPerWord = 32 / kBits;
  static constexpr int kWords = kPerLane / kPerWord;
  static constexpr int kBytes = kPerLane * kBits / 8;
  static constexpr uint32_t kMask = (1u << kBits) - 1;
  uint32_t word[kWords];

  // Value k, zero-extended. A byte by one byte permute (a shift and a mask
  // otherwise), which the compiler does not see through, so that an index
  // made of it keeps one multiply-add.
  __device__ __forceinline__ uint32_t operator[](int k) const {
    if constexpr (kBits == 8) return __byte_perm(word[k / kPerWord], 0, 0x4440 + k % kPerWord);
    return word[k / kPerWord] >> (k % kPerWord * kBits) & kMask;
  }

  // The words of kPerLane values, each below 2^kBits (codes as an encode
  // gives them, or the low halves of 32-bit words): byte permutes for bytes
  // and halves, which take only the bytes they name; for nibbles a sum of
  // shifted values, one shift-and-add each, which equals their bitwise or
  // because no two overlap.
  static __device__ __forceinline__ LaneBits pack(const uint32_t (&v)[kPerLane]) {
    LaneBits out;
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      if constexpr (kBits == 16) {
        out.word[j] = __byte_perm(v[2 * j], v[2 * j + 1], 0x5410);
      } else if constexpr (kBits == 8) {
        out.word[j] = __byte_perm(__byte_perm(v[4 * j], v[4 * j + 1], 0x0040),
                                  __byte_perm(v[4 * j + 2], v[4 * j + 3], 0x0040), 0x5410);
      } else {
        uint32_t w = v[kPerWord * j];
#pragma unroll
        for (int k = 1; k < kPerWord; ++k) w += v[kPerWord * j + k] << (k * kBits);
        out.word[j] = w;
      }
    }
    return out;
  }
};

// The lane's kPerLane values from p (the byte that holds the first), n of
// them valid: one vector load when all are (`vectorized`: p is aligned to
// the lane's kBytes); otherwise the bytes that hold valid values, the rest
// 0 (a 4-bit odd n: the last byte's high nibble as memory has it).
template <int kBits>
__device__ __forceinline__ void load_bits(LaneBits<kBits>& dst, const void* p, int n, bool vectorized) {
  using Lane = LaneBits<kBits>;
  if (vectorized && n == kPerLane) return load<Lane::kWords>(dst.word, static_cast<const uint32_t*>(p), true);
  const auto* bytes = static_cast<const uint8_t*>(p);
#pragma unroll
  for (int j = 0; j < Lane::kWords; ++j) dst.word[j] = 0;
#pragma unroll
  for (int i = 0; i < Lane::kBytes; ++i) {
    if (i * 8 < n * kBits) dst.word[i / 4] |= static_cast<uint32_t>(bytes[i]) << (i % 4 * 8);
  }
}

// Stores the lane's first n values at p: one vector store when all kPerLane
// are (`vectorized` as for load_bits); otherwise the bytes that hold them,
// the bits of values past n cleared (a 4-bit odd n: the last byte's high
// nibble 0, as store_block4 leaves it).
template <int kBits>
__device__ __forceinline__ void store_bits(void* p, const LaneBits<kBits>& src, int n, bool vectorized) {
  using Lane = LaneBits<kBits>;
  if (vectorized && n == kPerLane) return store<Lane::kWords>(static_cast<uint32_t*>(p), src.word, true);
  auto* bytes = static_cast<uint8_t*>(p);
#pragma unroll
  for (int i = 0; i < Lane::kBytes; ++i) {
    const int valid_bits = n * kBits - i * 8;  // of this byte's 8
    if (valid_bits > 0) {
      const uint32_t byte = src.word[i / 4] >> (i % 4 * 8) & 0xffu;
      bytes[i] = static_cast<uint8_t>(valid_bits >= 8 ? byte : byte & ((1u << valid_bits) - 1));
    }
  }
}

// The lane's kPerLane values from p in f32 (`n` and `vectorized` as for
// load_lane). A 16-bit type comes from its words: a bf16 is its f32's top
// half, one shift or mask each where unpacking took two.
template <class T>
__device__ __forceinline__ void load_lane_f32(float (&dst)[kPerLane], const T* p, int n, bool vectorized) {
  if constexpr (sizeof(T) == 2) {
    LaneBits<16> bits;
    load_bits(bits, p, n, vectorized);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) dst[k] = __uint_as_float(bits[k] << 16);
      else dst[k] = to_compute<float>(__ushort_as_half(static_cast<unsigned short>(bits[k])));
    }
  } else {
    T v[kPerLane];
    load_lane(v, p, n, vectorized);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) dst[k] = to_compute<float>(v[k]);
  }
}

// Calls f(true) when `whole` (every value of the span valid and the
// addresses aligned for vector access) and f(false) otherwise, so that the
// loads and stores f makes, each taking `whole`, share one branch: the
// constant folds each one's own test away.
template <class F>
__device__ __forceinline__ void split_span(bool whole, F&& f) {
  if (whole) f(true);
  else f(false);
}

// Folds the lane's first n values into a block's absmax (bit patterns,
// backend::absmax_bits_fold). A whole span folds each value in two integer
// operations; a short last block's lane (rare) folds 0 past its end.
__device__ __forceinline__ void fold_lane_absmax(uint32_t& absmax_bits, const float (&values)[kPerLane], int n) {
  if (n == kPerLane) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) absmax_bits = backend::absmax_bits_fold(absmax_bits, backend::magnitude_bits(values[k]));
    return;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    absmax_bits = backend::absmax_bits_fold(absmax_bits, k < n ? backend::magnitude_bits(values[k]) : 0u);
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
