// LAMB's two passes over 8- or 4-bit moments on the CPU, block by block, with
// the element formulas and the block rule of backend/lamb_blockwise.h and
// each block's sums added in the order of the CUDA lanes that own the block
// (a warp for an 8-bit block, a half-warp for a 4-bit one). Included by
// cpu/lamb.cc (its run() calls these as it calls PlainMoments).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backend/blockwise4_math.h"
#include "backend/lamb.h"
#include "backend/lamb_blockwise.h"
#include "backend/quant_tables.h"
#include "cpu/isa.h"
#include "cpu/master_weights.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::backend {

// Where a form keeps element i's code, and how a block is encoded and stored.
struct LambCodec8 {
  using Tables = QuantTables;
  static constexpr int kBlock = kQuantBlock;
  static constexpr int kCodesPerByte = 1;
  static const Tables& tables(const LambLaunch& l) { return *l.tables; }
  static uint8_t code(const uint8_t* q, int64_t i) { return q[i]; }
  static float encode(const QuantTable& t, const float* values, int n, uint8_t* codes) {
    float absmax;
    encode_block(t, values, n, codes, &absmax);
    return absmax;
  }
  static void store(uint8_t* q, int64_t base, const uint8_t* codes, int n) { std::copy(codes, codes + n, q + base); }
};

// Two codes a byte (element 2k in the low nibble); a block starts on an even
// element, so on a byte, and an odd tensor's last high nibble is 0.
struct LambCodec4 {
  using Tables = QuantTables4;
  static constexpr int kBlock = kQuant4Block;
  static constexpr int kCodesPerByte = 2;
  static const Tables& tables(const LambLaunch& l) { return *l.tables4; }
  static uint8_t code(const uint8_t* q, int64_t i) { return code4_at(q, i); }
  static float encode(const QuantTable4& t, const float* values, int n, uint8_t* codes) {
    return encode_block4(t, values, n, codes);
  }
  static void store(uint8_t* q, int64_t base, const uint8_t* codes, int n) { store_block4(codes, n, q, base); }
};

template <class G, class Codec>
struct BlockwiseMoments {
  using C = float;
  static constexpr int kBlock = Codec::kBlock;
  static constexpr int kBlockLanes = kBlock / kLaneElements;  // the CUDA lanes that own a block

  // Pass 1: each block's moments encoded anew (or the block kept and
  // marked), and the chunk's sums (sums[0]: w^2, sums[1]: d^2): each
  // block's, in block order. Scalar loops: `isa` is not used.
  static void norms(const cpu::ChunkView& chunk, const LambLaunch& l, const LambCoefficients<float>& c, double* sums,
                    cpu::Isa) {
    double w2c = 0, d2c = 0;
    const typename Codec::Tables& t = Codec::tables(l);
    const float* w = chunk.tensor<float>(0);
    const G* g = chunk.tensor<G>(1);
    uint8_t* qm = chunk.block_tensor<uint8_t>(2, Codec::kCodesPerByte);
    uint8_t* qv = chunk.block_tensor<uint8_t>(3, Codec::kCodesPerByte);
    float* absmax_m = chunk.block_tensor<float>(l.absmax_list, kBlock);
    float* absmax_v = chunk.block_tensor<float>(l.absmax_list + 1, kBlock);
    for (int64_t b = 0; b * kBlock < chunk.chunk.length; ++b) {
      const int64_t base = b * kBlock;
      const int n = static_cast<int>(std::min<int64_t>(kBlock, chunk.chunk.length - base));
      float m_new[kBlock], v_new[kBlock];
      uint8_t qm_new[kBlock + 1], qv_new[kBlock + 1];
      for (int k = 0; k < n; ++k) {
        lamb_blockwise_moments(cpu::to_compute<float>(g[base + k]), Codec::code(qm, base + k),
                               Codec::code(qv, base + k), absmax_m[b], absmax_v[b], t, c, m_new[k], v_new[k]);
      }
      const float amax_m = Codec::encode(t.table[0], m_new, n, qm_new);
      const float amax_v = Codec::encode(t.table[1], v_new, n, qv_new);
      double w2[kBlockLanes] = {}, d2[kBlockLanes] = {};
      bool all_finite = true;
      for (int k = 0; k < n; ++k) {
        const float wk = w[base + k];
        const float d = lamb_blockwise_direction(wk, qm_new[k], qv_new[k], amax_m, amax_v, t, c);
        all_finite = all_finite && finite(d);
        w2[k / kLaneElements] += static_cast<double>(wk) * wk;
        d2[k / kLaneElements] += static_cast<double>(d) * d;
      }
      w2c += warp_tree_sum(w2);
      if (all_finite) {
        d2c += warp_tree_sum(d2);
        Codec::store(qm, base, qm_new, n);
        Codec::store(qv, base, qv_new, n);
        absmax_m[b] = amax_m;
        absmax_v[b] = amax_v;
      } else {
        absmax_m[b] = lamb_flip_mark(absmax_m[b]);
      }
    }
    sums[0] = w2c;
    sums[1] = d2c;
  }

  // Pass 2: the weights (or, with Update, their change in the update list)
  // and the model copy when Copy is f16 or bf16; a marked block's weights
  // stay and its mark is cleared.
  template <class Copy, bool Update>
  static void update(const cpu::ChunkView& chunk, const LambLaunch& l, const LambCoefficients<float>& c, float step,
                     cpu::Isa) {
    const typename Codec::Tables& t = Codec::tables(l);
    float* w = chunk.tensor<float>(0);
    float* update_list = Update ? chunk.tensor<float>(l.update_list) : nullptr;
    Copy* copy = cpu_master::copy_of<Copy>(chunk, l);
    const uint8_t* qm = chunk.block_tensor<uint8_t>(2, Codec::kCodesPerByte);
    const uint8_t* qv = chunk.block_tensor<uint8_t>(3, Codec::kCodesPerByte);
    float* absmax_m = chunk.block_tensor<float>(l.absmax_list, kBlock);
    const float* absmax_v = chunk.block_tensor<float>(l.absmax_list + 1, kBlock);
    for (int64_t b = 0; b * kBlock < chunk.chunk.length; ++b) {
      const int64_t base = b * kBlock;
      const int n = static_cast<int>(std::min<int64_t>(kBlock, chunk.chunk.length - base));
      const bool marked = lamb_marked(absmax_m[b]);
      for (int k = 0; k < n; ++k) {
        const int64_t i = base + k;
        const float w_old = w[i];
        const float w_new = marked ? w_old
                                   : lamb_blockwise_update(w_old, Codec::code(qm, i), Codec::code(qv, i), absmax_m[b],
                                                           absmax_v[b], t, step, c);
        if constexpr (Update) update_list[i] = w_new - w_old;
        else w[i] = w_new;
        cpu_master::store_copy(copy, i, w_new);
      }
      if (marked) absmax_m[b] = lamb_flip_mark(absmax_m[b]);
    }
  }
};

}  // namespace gradkit::backend
