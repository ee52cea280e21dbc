// What the tests of adam_step with 8- and 4-bit moments share: their cases
// (decay modes, gradient dtypes, model copy, remainder weights, a gradient
// scale) and every tensor one step reads and writes, seeded, with moments
// that span decades encoded by gradkit's own whole-tensor encoder.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/blockwise.h"
#include "gradkit/ops/master.h"
#include "support/adam_config.h"
#include "support/eight_bit.h"
#include "support/test_tensor.h"

namespace gradkit::test {

inline std::vector<AdamConfig> low_bit_configs() {
  std::vector<AdamConfig> out;
  AdamConfig adamw{"adamw"};
  adamw.h.weight_decay = 0.01f;
  out.push_back(adamw);
  AdamConfig l2{"l2_bf16_grads_bf16_copy"};
  l2.h.decay = WeightDecay::l2;
  l2.h.weight_decay = 0.05f;
  l2.grad = DType::bf16;
  l2.copy = DType::bf16;
  out.push_back(l2);
  AdamConfig hf{"hugging_face_f16_grads_scaled"};
  hf.h.decay = WeightDecay::hugging_face;
  hf.h.weight_decay = 0.02f;
  hf.grad = DType::f16;
  hf.grad_scale = 1024.0f;
  out.push_back(hf);
  AdamConfig pair{"remainder_weights_maximize_nobias"};
  pair.h.maximize = true;
  pair.h.bias_correction = false;
  pair.remainder = true;
  pair.grad = DType::bf16;
  out.push_back(pair);
  return out;
}

inline QuantCode moment_code(bool first) { return first ? QuantCode::signed_dynamic : QuantCode::unsigned_dynamic; }

// Everything one low-bit step reads and writes, on one device: tensors of
// `sizes` elements, moments of `bits` (8 or 4) whose seeded values span
// `decades` below 1e-2 (m) and their squares' (v).
struct LowBitTensors {
  int32_t bits;
  std::vector<TestTensor> w, rem, copy, g, m, v, am, av;
  std::vector<TensorView> wv, rv, cv, gv, mv, vv, amv, avv;

  LowBitTensors(Device device, const AdamConfig& c, uint64_t seed, int32_t moment_bits,
                const std::vector<int64_t>& sizes, int m_decades, int v_decades)
      : bits(moment_bits) {
    std::mt19937_64 rng(seed);
    for (int64_t n : sizes) {
      const std::vector<double> master = round_to(DType::f32, random_values(rng, n));
      if (c.remainder) {
        const TestTensor f32(device, DType::f32, master);
        w.emplace_back(device, DType::bf16, std::vector<double>(n, 0.0));
        rem.emplace_back(device, DType::i16, std::vector<double>(n, 0.0));
        split_masters(f32.view(), w.back().view(), rem.back().view());
      } else {
        w.emplace_back(device, DType::f32, master);
      }
      copy.emplace_back(device, DType::bf16, std::vector<double>(n, 0.0));
      g.emplace_back(device, c.grad, round_to(c.grad, random_values(rng, n, c.grad_scale)));
      const int64_t bytes = bits == 4 ? quant4_bytes(n) : n, blocks = bits == 4 ? quant4_blocks(n) : quant_blocks(n);
      m.emplace_back(device, DType::u8, std::vector<double>(bytes, 0.0));
      v.emplace_back(device, DType::u8, std::vector<double>(bytes, 0.0));
      am.emplace_back(device, DType::f32, std::vector<double>(blocks, 0.0));
      av.emplace_back(device, DType::f32, std::vector<double>(blocks, 0.0));
      const TestTensor m0(device, DType::f32, moment_values(rng, n, true, -m_decades)),
          v0(device, DType::f32, moment_values(rng, n, false, -v_decades));
      encode(true, m0, m.back(), am.back());
      encode(false, v0, v.back(), av.back());
    }
    refresh_views();
  }
  void encode(bool first, const TestTensor& values, TestTensor& codes, TestTensor& absmax) const {
    if (bits == 4) quantize_blockwise4(moment_code(first), values.view(), codes.view(), absmax.view());
    else quantize_blockwise(moment_code(first), values.view(), codes.view(), absmax.view());
  }
  void refresh_views() {
    wv = views(w), rv = views(rem), cv = views(copy), gv = views(g), mv = views(m), vv = views(v), amv = views(am),
    avv = views(av);
  }
  AdamTensors tensors(const AdamConfig& c) const {
    AdamTensors t{wv, gv, mv, vv, {}, {}, amv, avv, {}};
    t.moment_bits = bits;
    if (c.copy != DType::f32) t.model_copy = cv;
    if (c.remainder) t.weight_remainder = rv;
    return t;
  }
  std::vector<double> masters(size_t i) const {
    if (rem.empty()) return w[i].read();
    TestTensor out(w[i].view().device, DType::f32, std::vector<double>(w[i].numel(), 0.0));
    join_masters(w[i].view(), rem[i].view(), out.view());
    return out.read();
  }
  std::vector<double> decoded(size_t i, bool first) const {
    TestTensor out(w[i].view().device, DType::f32, std::vector<double>(w[i].numel(), 0.0));
    const TestTensor& codes = (first ? m : v)[i];
    const TestTensor& absmax = (first ? am : av)[i];
    if (bits == 4) dequantize_blockwise4(moment_code(first), codes.view(), absmax.view(), out.view());
    else dequantize_blockwise(moment_code(first), codes.view(), absmax.view(), out.view());
    return out.read();
  }
  // Tensor i's codes of m (first) or v, one per element (4-bit: unpacked, the
  // low nibble first).
  std::vector<double> codes(size_t i, bool first) const {
    const std::vector<double> stored = (first ? m : v)[i].read();
    if (bits == 8) return stored;
    std::vector<double> out(static_cast<size_t>(w[i].numel()));
    for (size_t e = 0; e < out.size(); ++e) out[e] = (static_cast<int>(stored[e / 2]) >> ((e & 1) * 4)) & 0x0f;
    return out;
  }
  int64_t block() const { return bits == 4 ? kQuant4Block : kQuantBlock; }
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &rem, &copy, &m, &v, &am, &av}) {
      for (const auto& t : *list) out.push_back(t.bytes());
    }
    return out;
  }
};

}  // namespace gradkit::test
