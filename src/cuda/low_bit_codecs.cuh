// The two forms of blockwise moments as the CUDA kernels meet them
// (cuda/adam_low_bit.cu, cuda/lamb_low_bit.cu): their tables, where a lane's
// kPerLane codes lie, and how many lanes own a block (low_bit_lanes.cuh).
// A launch (AdamLaunch, LambLaunch) carries `tables` (8-bit) and `tables4`.
#pragma once

#include <cstdint>
#include <type_traits>

#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_int8_math.h"
#include "cuda/low_bit_lanes.cuh"

namespace gradkit::cuda {

using spec::dequantize;
using spec::dequantize4;
using spec::QuantTables;
using spec::QuantTables4;

// q + 1 when x > y, else q (a NaN on either side: q), as a compare and a
// predicated add (the compiler's form of q + (x > y ? 1 : 0) takes a compare,
// an add and a select).
__device__ __forceinline__ uint32_t add_if_greater(uint32_t q, float x, float y) {
  asm("{\n\t"
      ".reg .pred p;\n\t"
      "setp.gt.f32 p, %1, %2;\n\t"
      "@p add.u32 %0, %0, 1;\n\t"
      "}"
      : "+r"(q)
      : "f"(x), "f"(y));
  return q;
}

// spec::bucketed_count, the CPU backend's encode: the same count for
// every x, in fewer instructions (tests/test_low_bit_codecs_cuda.cu checks every
// f32 in all four tables against it, and against count_below where |x| < 2
// or x is NaN). Signed: the magnitude's buckets, then the sign's half of the
// starts; unsigned (a table whose decision points are all at least +0, the
// second moments'): the positive buckets only. The magnitude is clamped to
// [lowest bucket, 2.0] as floats, one min and one max whose absolute value
// is an operand modifier (the integer clamp takes a mask more); a NaN clamps
// to 2.0 (min returns the other operand), whose starts are 0 as in the
// integer form. The unsigned form clamps x itself: a negative x or -0 lands
// in the lowest bucket (the integer form: 2.0's), whose start is 0 and whose
// first decision point is at least 0, so it counts 0 there too.
template <class Table, bool kSigned>
__device__ __forceinline__ uint32_t bucketed_count_cuda(const Table& t, float x) {
  using Buckets = typename Table::Buckets;
  const float lowest = spec::bits_float(Buckets::kLowestBits);
  const float clamped = fmaxf(fminf(kSigned ? fabsf(x) : x, 2.0f), lowest);
  int bucket = static_cast<int>(__float_as_uint(clamped) >> Buckets::kShift) -
               static_cast<int>(Buckets::kLowestBits >> Buckets::kShift);
  if constexpr (kSigned) bucket += static_cast<int>(__float_as_uint(x) >> 31) * Buckets::kCount;
  uint32_t q = t.start[bucket];
#pragma unroll
  for (int k = 0; k < spec::kQuantSpan; ++k) q = add_if_greater(q, x, t.midpoints[q]);
  return q;
}

// The code of x (scaled by its block's 1 / absmax) in either form's tables:
// quantize's or quantize4's, not narrowed (the kernels pack codes from their
// low bits); exp_avg_sq's map (moment 1) is unsigned, so its count needs
// only the positive buckets.
template <class Tables>
__device__ __forceinline__ uint32_t encode_moment(const Tables& t, int moment, float x) {
  using Table = std::remove_cvref_t<decltype(t.table[0])>;
  return moment == 0 ? bucketed_count_cuda<Table, true>(t.table[0], x) : bucketed_count_cuda<Table, false>(t.table[1], x);
}

// The 8-bit form: one 256-element block per warp, one code a byte.
struct Codec8 {
  using Tables = QuantTables;
  using Codes = LaneBits<8>;  // a lane's codes
  static constexpr int kBlock = kQuantBlock;
  static constexpr int kLanesPerBlock = kLanes;
  static constexpr int kCodesPerByte = 1;
  static constexpr int kCodeBytes = Codes::kBytes;
  template <class Launch>
  static __device__ __forceinline__ const Tables* tables(const Launch& l) { return l.tables; }
  // Code k of a lane's codes.
  static __device__ __forceinline__ float decode(const Tables& t, int moment, const Codes& codes, int k, float absmax) {
    return dequantize(t.table[moment], codes[k], absmax);
  }
  static __device__ __forceinline__ uint32_t encode(const Tables& t, int moment, float x) {
    return encode_moment(t, moment, x);
  }
};

// The 4-bit form: two 128-element blocks per warp (lanes 0-15, 16-31), two
// codes a byte (element 2k in the low nibble), so a lane's 8 codes are the
// word at byte at / 2.
struct Codec4 {
  using Tables = QuantTables4;
  using Codes = LaneBits<4>;
  static_assert(Codes::kWords == 1, "a lane's codes in one word (decode)");
  static constexpr int kBlock = kQuant4Block;
  static constexpr int kLanesPerBlock = kBlock / kPerLane;  // 16
  static constexpr int kCodesPerByte = 2;
  static constexpr int kCodeBytes = Codes::kBytes;
  template <class Launch>
  static __device__ __forceinline__ const Tables* tables(const Launch& l) { return l.tables4; }
  // Code k of a lane's codes, from its byte (dequantize4_byte).
  static __device__ __forceinline__ float decode(const Tables& t, int moment, const Codes& codes, int k, float absmax) {
    return spec::dequantize4_byte(t.table[moment], __byte_perm(codes.word[0], 0, 0x4440 + k / 2), k % 2, absmax);
  }
  static __device__ __forceinline__ uint32_t encode(const Tables& t, int moment, float x) {
    return encode_moment(t, moment, x);
  }
};

// A lane's codes from a tensor's packed codes q, in its span (LaneSpan:
// quads when whole), and back from the codes an encode gave; or from its
// first element `at`, n valid (`vectorized` as for load_bits).
template <class Codec>
__device__ __forceinline__ void load_codes(typename Codec::Codes& codes, const uint8_t* q, const LaneSpan& s,
                                           bool whole) {
  load_bits(codes, q, s, whole);
}
template <class Codec>
__device__ __forceinline__ void store_codes(uint8_t* q, const uint32_t (&codes)[kPerLane], const LaneSpan& s,
                                            bool whole) {
  store_bits(q, Codec::Codes::pack(codes), s, whole);
}
template <class Codec>
__device__ __forceinline__ void load_codes(typename Codec::Codes& codes, const uint8_t* q, int at, int n, bool vec) {
  load_codes<Codec>(codes, q, contiguous_span(at, n), vec);
}
template <class Codec>
__device__ __forceinline__ void store_codes(uint8_t* q, int at, const uint32_t (&codes)[kPerLane], int n, bool vec) {
  store_codes<Codec>(q, codes, contiguous_span(at, n), vec);
}
// The lane's span in the form's blocks (lane_span).
template <class Codec>
__device__ __forceinline__ LaneSpan codec_span(int b, int at, int n) {
  return lane_span<Codec::kBlock, Codec::kLanesPerBlock>(b, at, n);
}

// Asks L2 for the lines of the weights, gradients and both moments' codes of
// the lane's span from element `at` (the kernels' prefetch ahead).
template <class Codec, class W, class G>
__device__ __forceinline__ void prefetch_span(int at, const W* w, const G* g, const uint8_t* qm, const uint8_t* qv) {
  prefetch_l2(w + at);
  prefetch_l2(g + at);
  prefetch_l2(qm + at / Codec::kCodesPerByte);
  prefetch_l2(qv + at / Codec::kCodesPerByte);
}

}  // namespace gradkit::cuda
