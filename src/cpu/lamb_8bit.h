// LAMB's two passes over 8-bit moments on the CPU, block by block, with the
// element formulas and the block rule of backend/lamb_blockwise.h and each
// block's sums added in the order of the CUDA warp that owns the block.
// Included by cpu/lamb.cc (its run() calls these as it calls PlainMoments).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backend/lamb.h"
#include "backend/lamb_blockwise.h"
#include "backend/quant_tables.h"
#include "cpu/isa.h"
#include "cpu/master_weights.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::backend {

template <class G>
struct BlockwiseMoments {
  using C = float;

  // Pass 1: each block's moments encoded anew (or the block kept and
  // marked), and the chunk's sums (sums[0]: w^2, sums[1]: d^2): each
  // block's, in block order. Scalar loops: `isa` is not used.
  static void norms(const cpu::ChunkView& chunk, const LambLaunch& l, const LambCoefficients<float>& c, double* sums,
                    cpu::Isa) {
    double w2c = 0, d2c = 0;
    const QuantTables& t = *l.tables;
    const float* w = chunk.tensor<float>(0);
    const G* g = chunk.tensor<G>(1);
    uint8_t* qm = chunk.tensor<uint8_t>(2);
    uint8_t* qv = chunk.tensor<uint8_t>(3);
    float* absmax_m = chunk.block_tensor<float>(l.absmax_list, kQuantBlock);
    float* absmax_v = chunk.block_tensor<float>(l.absmax_list + 1, kQuantBlock);
    for (int64_t b = 0; b * kQuantBlock < chunk.chunk.length; ++b) {
      const int64_t base = b * kQuantBlock;
      const int n = static_cast<int>(std::min<int64_t>(kQuantBlock, chunk.chunk.length - base));
      float m_new[kQuantBlock], v_new[kQuantBlock], amax_m, amax_v;
      uint8_t qm_new[kQuantBlock], qv_new[kQuantBlock];
      for (int k = 0; k < n; ++k) {
        lamb_8bit_moments(cpu::to_compute<float>(g[base + k]), qm[base + k], qv[base + k], absmax_m[b], absmax_v[b], t,
                          c, m_new[k], v_new[k]);
      }
      encode_block(t.table[0], m_new, n, qm_new, &amax_m);
      encode_block(t.table[1], v_new, n, qv_new, &amax_v);
      double w2[kWarpLanes] = {}, d2[kWarpLanes] = {};
      bool all_finite = true;
      for (int k = 0; k < n; ++k) {
        const float wk = w[base + k];
        const float d = lamb_8bit_direction(wk, qm_new[k], qv_new[k], amax_m, amax_v, t, c);
        all_finite = all_finite && finite(d);
        w2[k / kLaneElements] += static_cast<double>(wk) * wk;
        d2[k / kLaneElements] += static_cast<double>(d) * d;
      }
      w2c += warp_tree_sum(w2);
      if (all_finite) {
        d2c += warp_tree_sum(d2);
        std::copy(qm_new, qm_new + n, qm + base);
        std::copy(qv_new, qv_new + n, qv + base);
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
    const QuantTables& t = *l.tables;
    float* w = chunk.tensor<float>(0);
    float* update_list = Update ? chunk.tensor<float>(l.update_list) : nullptr;
    Copy* copy = cpu_master::copy_of<Copy>(chunk, l);
    const uint8_t* qm = chunk.tensor<uint8_t>(2);
    const uint8_t* qv = chunk.tensor<uint8_t>(3);
    float* absmax_m = chunk.block_tensor<float>(l.absmax_list, kQuantBlock);
    const float* absmax_v = chunk.block_tensor<float>(l.absmax_list + 1, kQuantBlock);
    for (int64_t b = 0; b * kQuantBlock < chunk.chunk.length; ++b) {
      const int64_t base = b * kQuantBlock;
      const int n = static_cast<int>(std::min<int64_t>(kQuantBlock, chunk.chunk.length - base));
      const bool marked = lamb_marked(absmax_m[b]);
      for (int k = 0; k < n; ++k) {
        const int64_t i = base + k;
        const float w_old = w[i];
        const float w_new = marked ? w_old : lamb_8bit_update(w_old, qm[i], qv[i], absmax_m[b], absmax_v[b], t, step, c);
        if constexpr (Update) update_list[i] = w_new - w_old;
        else w[i] = w_new;
        cpu_master::store_copy(copy, i, w_new);
      }
      if (marked) absmax_m[b] = lamb_flip_mark(absmax_m[b]);
    }
  }
};

}  // namespace gradkit::backend
