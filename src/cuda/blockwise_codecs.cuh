// The two forms of blockwise moments as the CUDA kernels meet them
// (cuda/adam_low_bit.cu, cuda/lamb_low_bit.cu): their tables, where a lane's
// kPerLane codes lie, and how many lanes own a block (blockwise_lanes.cuh).
// A launch (AdamLaunch, LambLaunch) carries `tables` (8-bit) and `tables4`.
#pragma once

#include <cstdint>

#include "backend/blockwise4_math.h"
#include "backend/blockwise_math.h"
#include "cuda/blockwise_lanes.cuh"

namespace gradkit::cuda {

using backend::dequantize;
using backend::dequantize4;
using backend::nibble;
using backend::pack_nibbles;
using backend::QuantTables;
using backend::QuantTables4;
using backend::quantize;
using backend::quantize4;

// The 8-bit form: one 256-element block per warp, one code a byte.
struct Codec8 {
  using Tables = QuantTables;
  static constexpr int kBlock = kQuantBlock;
  static constexpr int kLanesPerBlock = kLanes;
  static constexpr int kCodesPerByte = 1;
  static constexpr int kCodeBytes = kPerLane / kCodesPerByte;  // a lane's codes
  template <class Launch>
  static __device__ __forceinline__ const Tables* tables(const Launch& l) { return l.tables; }
  static __device__ __forceinline__ void load(uint8_t (&codes)[kPerLane], const uint8_t* q, int at, int n, bool vec) {
    load_lane(codes, q + at, n, vec);
  }
  static __device__ __forceinline__ void store(uint8_t* q, int at, const uint8_t (&codes)[kPerLane], int n, bool vec) {
    store_lane(q + at, codes, n, vec);
  }
  static __device__ __forceinline__ float decode(const Tables& t, int moment, uint8_t code, float absmax) {
    return dequantize(t.table[moment], code, absmax);
  }
  static __device__ __forceinline__ uint8_t encode(const Tables& t, int moment, float x) {
    return quantize(t.table[moment], x);
  }
};

// The 4-bit form: two 128-element blocks per warp (lanes 0-15, 16-31), two
// codes a byte, so a lane's 8 codes are 4 bytes from byte at / 2.
struct Codec4 {
  using Tables = QuantTables4;
  static constexpr int kBlock = kQuant4Block;
  static constexpr int kLanesPerBlock = kBlock / kPerLane;  // 16
  static constexpr int kCodesPerByte = 2;
  static constexpr int kCodeBytes = kPerLane / kCodesPerByte;
  template <class Launch>
  static __device__ __forceinline__ const Tables* tables(const Launch& l) { return l.tables4; }
  static __device__ __forceinline__ void load(uint8_t (&codes)[kPerLane], const uint8_t* q, int at, int n, bool vec) {
    uint8_t bytes[kPerLane / 2];
    const uint8_t* p = q + at / 2;
    if (vec && n == kPerLane) {
      cuda::load<kPerLane / 2>(bytes, p, true);
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane / 2; ++k) bytes[k] = 2 * k < n ? p[k] : uint8_t{0};
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) codes[k] = nibble(bytes[k / 2], k);
  }
  static __device__ __forceinline__ void store(uint8_t* q, int at, const uint8_t (&codes)[kPerLane], int n, bool vec) {
    uint8_t bytes[kPerLane / 2];
#pragma unroll
    for (int k = 0; k < kPerLane / 2; ++k) bytes[k] = pack_nibbles(codes[2 * k], 2 * k + 1 < n ? codes[2 * k + 1] : 0);
    uint8_t* p = q + at / 2;
    if (vec && n == kPerLane) return cuda::store<kPerLane / 2>(p, bytes, true);
#pragma unroll
    for (int k = 0; k < kPerLane / 2; ++k) {
      if (2 * k < n) p[k] = bytes[k];
    }
  }
  static __device__ __forceinline__ float decode(const Tables& t, int moment, uint8_t code, float absmax) {
    return dequantize4(t.table[moment], code, absmax);
  }
  static __device__ __forceinline__ uint8_t encode(const Tables& t, int moment, float x) {
    return quantize4(t.table[moment], x);
  }
};

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
