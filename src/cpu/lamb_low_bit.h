// LAMB's two passes over 8- or 4-bit moments on the CPU, block by block, with
// the element formulas and the block rule of spec/lamb_low_bit.h and
// each block's sums added in the order of the CUDA lanes that own the block
// (a warp for an 8-bit block, a half-warp for a 4-bit one); the blocks'
// decode and encode are Adam's (cpu/low_bit_codecs.h), and each pass runs
// in the copy for the active instruction set (isa.h). Included by
// cpu/lamb.cc (its run() calls these as it calls PlainMoments).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "spec/low_bit_int4_math.h"
#include "spec/lamb.h"
#include "spec/lamb_low_bit.h"
#include "spec/low_bit_tables.h"
#include "cpu/low_bit_codecs.h"
#include "cpu/isa.h"
#include "cpu/master_weights.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::spec {
namespace cpu_lamb_low_bit {

using cpu_low_bit::block_bytes;

// Pass 1 over one chunk (whole blocks: a chunk starts on a block): each
// block's moments encoded anew (or the block kept and marked), and the
// chunk's sums (sums[0]: w^2, sums[1]: d^2): each block's, in block order.
// Each step is a loop over the block's values (decode, moments, encode,
// decode of the new codes, direction), so that each vectorizes.
template <class Codec, class G>
struct Pass1 {
  static constexpr int kBlock = Codec::kBlock;
  static constexpr int kBlockLanes = kBlock / kLaneElements;  // the CUDA lanes that own a block
  static void run(int64_t length, const float* __restrict w, const G* __restrict g, uint8_t* __restrict qm,
                  uint8_t* __restrict qv, float* __restrict absmax_m, float* __restrict absmax_v, Codec codec,
                  LambCoefficients<float> c, double* sums) {
    double w2c = 0, d2c = 0;
    alignas(64) float m[kBlock], v[kBlock], m_stored[kBlock], v_stored[kBlock];
    alignas(64) double w_squares[kBlock], d_squares[kBlock];
    alignas(64) uint8_t qm_new[kBlock], qv_new[kBlock];
    for (int64_t b = 0; b * kBlock < length; ++b) {
      const int64_t base = b * kBlock;
      const int n = static_cast<int>(std::min<int64_t>(kBlock, length - base));
      codec.decode(0, qm, base, absmax_m[b], n, m);
      codec.decode(1, qv, base, absmax_v[b], n, v);
      for (int k = 0; k < n; ++k) lamb_moments_folded(cpu::to_compute<float>(g[base + k]), m[k], v[k], c);
      float amax_m, amax_v;
      codec.encode(0, m, n, qm_new, 0, &amax_m);
      codec.encode(1, v, n, qv_new, 0, &amax_v);
      // The direction from the stored (encoded) moments.
      codec.decode(0, qm_new, 0, amax_m, n, m_stored);
      codec.decode(1, qv_new, 0, amax_v, n, v_stored);
      // Whether any d is Inf or NaN.
      uint32_t non_finite = 0;
      for (int k = 0; k < n; ++k) {
        const float wk = w[base + k];
        const float d = lamb_direction_folded(wk, m_stored[k], lamb_folded_reciprocal(v_stored[k], c), c);
        non_finite |= non_finite_bit(d);
        w_squares[k] = static_cast<double>(wk) * wk;
        d_squares[k] = static_cast<double>(d) * d;
      }
      const bool all_finite = non_finite == 0;
      // Each lane's elements in order, then the lanes' tree; the lanes side
      // by side, so that the adds vectorize across them. A short block's
      // lanes past its end hold 0.
      if (n < kBlock) {
        std::fill(w_squares + n, w_squares + kBlock, 0.0);
        std::fill(d_squares + n, d_squares + kBlock, 0.0);
      }
      double w2[kBlockLanes] = {}, d2[kBlockLanes] = {};
      for (int j = 0; j < kLaneElements; ++j) {
        for (int lane = 0; lane < kBlockLanes; ++lane) {
          w2[lane] += w_squares[lane * kLaneElements + j];
          d2[lane] += d_squares[lane * kLaneElements + j];
        }
      }
      w2c += warp_tree_sum(w2);
      if (all_finite) {
        d2c += warp_tree_sum(d2);
        const int bytes = block_bytes<Codec>(n);
        std::copy(qm_new, qm_new + bytes, qm + base / Codec::kCodesPerByte);
        std::copy(qv_new, qv_new + bytes, qv + base / Codec::kCodesPerByte);
        absmax_m[b] = amax_m;
        absmax_v[b] = amax_v;
      } else {
        absmax_m[b] = lamb_flip_mark(absmax_m[b]);
      }
    }
    sums[0] = w2c;
    sums[1] = d2c;
  }
};

// Pass 2 over one chunk: the weights (or, with Update, their change in the
// update list) and the model copy when Copy is f16 or bf16; a marked
// block's weights stay and its mark is cleared.
template <class Codec, class Copy, bool Update>
struct Pass2 {
  static constexpr int kBlock = Codec::kBlock;
  static void run(int64_t length, float* __restrict w, float* __restrict update, const uint8_t* __restrict qm,
                  const uint8_t* __restrict qv, float* __restrict absmax_m, const float* __restrict absmax_v,
                  Copy* __restrict copy, Codec codec, LambCoefficients<float> c, float step) {
    alignas(64) float m[kBlock], v[kBlock];
    for (int64_t b = 0; b * kBlock < length; ++b) {
      const int64_t base = b * kBlock;
      const int n = static_cast<int>(std::min<int64_t>(kBlock, length - base));
      const bool marked = lamb_marked(absmax_m[b]);
      if (marked) {
        absmax_m[b] = lamb_flip_mark(absmax_m[b]);
        for (int k = 0; k < n; ++k) {
          const int64_t i = base + k;
          if constexpr (Update) update[i] = w[i] - w[i];
          cpu_master::store_copy(copy, i, w[i]);
        }
        continue;
      }
      codec.decode(0, qm, base, absmax_m[b], n, m);
      codec.decode(1, qv, base, absmax_v[b], n, v);
      for (int k = 0; k < n; ++k) {
        const int64_t i = base + k;
        const float w_old = w[i];
        const float w_new =
            lamb_low_bit_apply(w_old, step, lamb_direction_folded(w_old, m[k], lamb_folded_reciprocal(v[k], c), c));
        if constexpr (Update) update[i] = w_new - w_old;
        else w[i] = w_new;
        cpu_master::store_copy(copy, i, w_new);
      }
    }
  }
};

}  // namespace cpu_lamb_low_bit

// The moments of LAMB's run() (cpu/lamb.cc) in either low-bit form (int8, int4), each
// pass in the active instruction set's copy.
template <class G, class Codec>
struct LowBitMoments {
  using C = float;

  static void norms(const cpu::ChunkView& chunk, const LambLaunch& l, const LambCoefficients<float>& c, double* sums,
                    cpu::Isa isa) {
    cpu::run_kernel<cpu_lamb_low_bit::Pass1<Codec, G>>(
        isa, int64_t{chunk.chunk.length}, static_cast<const float*>(chunk.tensor<float>(0)),
        static_cast<const G*>(chunk.tensor<G>(1)), chunk.block_tensor<uint8_t>(2, Codec::kCodesPerByte),
        chunk.block_tensor<uint8_t>(3, Codec::kCodesPerByte), chunk.block_tensor<float>(l.absmax_list, Codec::kBlock),
        chunk.block_tensor<float>(l.absmax_list + 1, Codec::kBlock), Codec::of(l, isa), c, sums);
  }

  template <class Copy, bool Update>
  static void update(const cpu::ChunkView& chunk, const LambLaunch& l, const LambCoefficients<float>& c, float step,
                     cpu::Isa isa) {
    cpu::run_kernel<cpu_lamb_low_bit::Pass2<Codec, Copy, Update>>(
        isa, int64_t{chunk.chunk.length}, chunk.tensor<float>(0),
        Update ? chunk.tensor<float>(l.update_list) : static_cast<float*>(nullptr),
        static_cast<const uint8_t*>(chunk.block_tensor<uint8_t>(2, Codec::kCodesPerByte)),
        static_cast<const uint8_t*>(chunk.block_tensor<uint8_t>(3, Codec::kCodesPerByte)),
        chunk.block_tensor<float>(l.absmax_list, Codec::kBlock),
        static_cast<const float*>(chunk.block_tensor<float>(l.absmax_list + 1, Codec::kBlock)),
        cpu_master::copy_of<Copy>(chunk, l), Codec::of(l, isa), c, step);
  }
};

}  // namespace gradkit::spec
