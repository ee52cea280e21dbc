// What the kernels over 8-bit and 4-bit moments share (cuda/adam_low_bit.cu,
// cuda/lamb_low_bit.cu): a warp owns one quantization block at a time, lane k
// the kPerLane consecutive elements from k * kPerLane; the code tables are
// copied into shared memory once per thread block.
#pragma once

#include <cstdint>
#include <type_traits>

#include "spec/low_bit_int8_math.h"
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
// bytes or halves, they would take a register each, be unpacked on load and
// masked again at use (3.5 instructions a code on the 8-bit path), and be
// masked and shifted back into bytes to be stored.
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

// Calls f(true) when `whole` (every value of the span valid and the
// addresses aligned for vector access) and f(false) otherwise, so that the
// loads and stores f makes, each taking `whole`, share one branch: the
// constant folds each one's own test away.
template <class F>
__device__ __forceinline__ void split_span(bool whole, F&& f) {
  if (whole) f(true);
  else f(false);
}

// Where a lane's kPerLane values lie in its warp's span of a chunk. A whole
// span (every element in the chunk, the lists aligned for vector access) is
// read and written in quads: kPerQuad consecutive elements from `quad_at`
// and kPerQuad more `half` elements later, so that each vector access of the
// warp covers consecutive memory. (A lane's 8 consecutive f32, as two
// 16-byte accesses 32 bytes apart, use half of each 32-byte sector an
// access; measured: bench/log/2026-11-27.md, "where the int8 kernel
// waits".) Any other span is read and written
// value by value, its first n values from `at` (the layout of
// for_each_warp_block). Each layout keeps a quantization block within its
// lanes, so the block's absmax is the same either way.
constexpr int kPerQuad = kPerLane / 2;
struct LaneSpan {
  int at, n;          // a span that is not whole
  int quad_at, half;  // a whole span
};

// The span of a lane of a warp whose blocks of `block` elements each belong
// to `lanes_per_block` lanes (the 8-bit form's one block a warp, the 4-bit
// form's two), for_each_warp_block's (b, at, n).
template <int kBlock, int kLanesPerBlock>
__device__ __forceinline__ LaneSpan lane_span(int b, int at, int n) {
  static_assert(kPerQuad * kLanesPerBlock * 2 == kBlock, "a block's lanes hold its two halves in quads");
  const int lane = threadIdx.x % kLanes;
  return {at, n, b * kQuantBlock + lane / kLanesPerBlock * kBlock + lane % kLanesPerBlock * kPerQuad, kBlock / 2};
}

// The layout of for_each_warp_block's spans, whole or not: the lane's
// kPerLane consecutive elements from `at`, n of them in the chunk.
__device__ __forceinline__ LaneSpan contiguous_span(int at, int n) { return {at, n, at, kPerQuad}; }

// The loads and stores of a lane's values in its span: in quads when
// `whole` (two vector accesses; one when the quads are consecutive, as
// contiguous_span's are), else value by value.
template <class T>
__device__ __forceinline__ void load_lane(T (&dst)[kPerLane], const T* base, const LaneSpan& s, bool whole) {
  if (!whole || s.half == kPerQuad) return load_lane(dst, base + s.at, s.n, whole);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const auto vec = *reinterpret_cast<const Vector<T, kPerQuad>*>(base + s.quad_at + q * s.half);
#pragma unroll
    for (int k = 0; k < kPerQuad; ++k) dst[q * kPerQuad + k] = vec.v[k];
  }
}

template <class T>
__device__ __forceinline__ void store_lane(T* base, const T (&src)[kPerLane], const LaneSpan& s, bool whole) {
  if (!whole || s.half == kPerQuad) return store_lane(base + s.at, src, s.n, whole);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    Vector<T, kPerQuad> vec;
#pragma unroll
    for (int k = 0; k < kPerQuad; ++k) vec.v[k] = src[q * kPerQuad + k];
    *reinterpret_cast<Vector<T, kPerQuad>*>(base + s.quad_at + q * s.half) = vec;
  }
}

// A quad of kBits values is a 16-bit word (nibbles), one word (bytes) or
// two (halves); `base` holds the list's value 0, value v at bit v * kBits.
template <int kBits>
__device__ __forceinline__ void load_bits(LaneBits<kBits>& dst, const void* base, const LaneSpan& s, bool whole) {
  const auto* bytes = static_cast<const uint8_t*>(base);
  if (!whole || s.half == kPerQuad) return load_bits(dst, bytes + s.at * kBits / 8, s.n, whole);
  const uint8_t* quad[2] = {bytes + s.quad_at * kBits / 8, bytes + (s.quad_at + s.half) * kBits / 8};
  if constexpr (kBits == 4) {
    dst.word[0] = __byte_perm(*reinterpret_cast<const uint16_t*>(quad[0]), *reinterpret_cast<const uint16_t*>(quad[1]),
                              0x5410);
  } else {
    constexpr int kQuadWords = LaneBits<kBits>::kWords / 2;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const auto vec = *reinterpret_cast<const Vector<uint32_t, kQuadWords>*>(quad[q]);
#pragma unroll
      for (int j = 0; j < kQuadWords; ++j) dst.word[q * kQuadWords + j] = vec.v[j];
    }
  }
}

template <int kBits>
__device__ __forceinline__ void store_bits(void* base, const LaneBits<kBits>& src, const LaneSpan& s, bool whole) {
  auto* bytes = static_cast<uint8_t*>(base);
  if (!whole || s.half == kPerQuad) return store_bits(bytes + s.at * kBits / 8, src, s.n, whole);
  uint8_t* quad[2] = {bytes + s.quad_at * kBits / 8, bytes + (s.quad_at + s.half) * kBits / 8};
  if constexpr (kBits == 4) {
    *reinterpret_cast<uint16_t*>(quad[0]) = static_cast<uint16_t>(src.word[0]);
    *reinterpret_cast<uint16_t*>(quad[1]) = static_cast<uint16_t>(src.word[0] >> 16);
  } else {
    constexpr int kQuadWords = LaneBits<kBits>::kWords / 2;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      Vector<uint32_t, kQuadWords> vec;
#pragma unroll
      for (int j = 0; j < kQuadWords; ++j) vec.v[j] = src.word[q * kQuadWords + j];
      *reinterpret_cast<Vector<uint32_t, kQuadWords>*>(quad[q]) = vec;
    }
  }
}

// The lane's values in f32. A 16-bit type comes from its words: a bf16 is
// its f32's top half, one shift or mask each where unpacking takes two.
template <class T>
__device__ __forceinline__ void load_lane_f32(float (&dst)[kPerLane], const T* base, const LaneSpan& s, bool whole) {
  if constexpr (sizeof(T) == 2) {
    LaneBits<16> bits;
    load_bits(bits, base, s, whole);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) dst[k] = __uint_as_float(bits[k] << 16);
      else dst[k] = to_compute<float>(__ushort_as_half(static_cast<unsigned short>(bits[k])));
    }
  } else {
    T v[kPerLane];
    load_lane(v, base, s, whole);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) dst[k] = to_compute<float>(v[k]);
  }
}

// The lane's kPerLane values from p in f32 (`n` and `vectorized` as for
// load_lane).
template <class T>
__device__ __forceinline__ void load_lane_f32(float (&dst)[kPerLane], const T* p, int n, bool vectorized) {
  load_lane_f32(dst, p, contiguous_span(0, n), vectorized);
}

// Folds the lane's first n values into a block's absmax (bit patterns,
// spec::absmax_bits_fold). A whole span folds each value in two integer
// operations; a short last block's lane (rare) folds 0 past its end.
__device__ __forceinline__ void fold_lane_absmax(uint32_t& absmax_bits, const float (&values)[kPerLane], int n) {
  if (n == kPerLane) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) absmax_bits = spec::absmax_bits_fold(absmax_bits, spec::magnitude_bits(values[k]));
    return;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    absmax_bits = spec::absmax_bits_fold(absmax_bits, k < n ? spec::magnitude_bits(values[k]) : 0u);
  }
}

// Asks L2 for the line that holds p, ahead of the load that will read it:
// no register waits for it, so a warp can have its next block's lines on
// their way from DRAM while it computes this one (the low-bit ops' register
// budgets, 64 or 80 a thread, leave no room to load them into registers
// early).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// How many of the kPerLane elements from a lane's first element `at` lie in
// a chunk of `length` (0 to kPerLane).
__device__ __forceinline__ int lane_count(int length, int at) { return min(kPerLane, max(0, length - at)); }

// One block b of for_each_warp_block's: the prefetch `ahead` blocks of the
// warp later, then body(b, at, n, tags...).
template <class Prefetch, class Body, class... Tags>
__device__ __forceinline__ void warp_block_step(int b, int length, int ahead, Prefetch& prefetch, Body& body,
                                                Tags... tags) {
  const int lane = threadIdx.x % kLanes, warps = blockDim.x / kLanes;
  const int at = b * kQuantBlock + lane * kPerLane;
  const int later = at + ahead * warps * kQuantBlock;
  if (ahead > 0 && later < length) prefetch(later);
  body(b, at, lane_count(length, at), tags...);
}

// Calls body(b, at, n) for each quantization block b of a chunk of `length`
// elements that this thread's warp owns (warp w: blocks w, w + warps, ...),
// from `first` (one of them; a kernel that did the warp's earlier blocks
// another way passes the next): `at` is the lane's first element, `n` how
// many of its kPerLane elements lie in the chunk (0 to kPerLane). Every lane
// of the warp calls body for the same blocks, so body may use the warp's
// shuffles. With `ahead` > 0, it first calls prefetch(at') with the lane's
// first element `ahead` blocks of this warp later, when that lies in the
// chunk.
template <class Prefetch, class Body>
__device__ __forceinline__ void for_each_warp_block(int length, int ahead, Prefetch&& prefetch, Body&& body,
                                                    int first = threadIdx.x / kLanes) {
  const int warps = blockDim.x / kLanes, blocks = (length + kQuantBlock - 1) / kQuantBlock;
  for (int b = first; b < blocks; b += warps) warp_block_step(b, length, ahead, prefetch, body);
}

// for_each_warp_block in two loops: body(b, at, n, std::true_type{}) for the
// first `whole` blocks, then body(b, at, n, std::false_type{}) for the rest,
// so that a body whose whole spans take other addresses (LaneSpan) holds
// only one layout's in each loop: in one loop, with both, the int8 kernel
// keeps both sets of pointers and spills 40 bytes at its 80 registers.
template <class Prefetch, class Body>
__device__ __forceinline__ void for_each_warp_block(int length, int whole, int ahead, Prefetch&& prefetch,
                                                    Body&& body, int first = threadIdx.x / kLanes) {
  const int warps = blockDim.x / kLanes, blocks = (length + kQuantBlock - 1) / kQuantBlock;
  int b = first;
  for (; b < whole; b += warps) warp_block_step(b, length, ahead, prefetch, body, std::true_type{});
  for (; b < blocks; b += warps) warp_block_step(b, length, ahead, prefetch, body, std::false_type{});
}

template <class Body>
__device__ __forceinline__ void for_each_warp_block(int length, Body&& body) {
  for_each_warp_block(length, 0, [](int) {}, body);
}

// Copies a form's tables (spec::QuantTables, QuantTables4) into `to`
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
