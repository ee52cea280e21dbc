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
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/master.h"
#include "support/adam_config.h"
#include "support/low_bit_checks.h"
#include "support/low_bit_moments.h"
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

// Everything one low-bit step reads and writes, on one device: tensors of
// `sizes` elements, moments of `bits` (8 or 4) whose seeded values span
// `decades` below 1e-2 (m) and their squares' (v).
struct LowBitTensors : LowBitMoments {
  std::vector<TestTensor> w, rem, copy, g;
  std::vector<TensorView> wv, rv, cv, gv, mv, vv, amv, avv;

  LowBitTensors(Device device, const AdamConfig& c, uint64_t seed, int32_t moment_bits,
                const std::vector<int64_t>& sizes, int m_decades, int v_decades)
      : LowBitMoments(moment_bits) {
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
      const std::vector<double> m0 = moment_values(rng, n, true, -m_decades);
      const std::vector<double> v0 = moment_values(rng, n, false, -v_decades);
      add_moments(device, m0, v0);
    }
    refresh_views();
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
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto* list : {&w, &rem, &copy, &m, &v, &am, &av}) {
      for (const auto& t : *list) out.push_back(t.bytes());
    }
    return out;
  }
};

}  // namespace gradkit::test
