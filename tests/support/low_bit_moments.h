// The 8- or 4-bit moments of a low-bit optimizer test (adam_step's and
// lamb_step's): each tensor's codes and absmax, encoded from seeded float
// values by gradkit's own whole-tensor encoders, and read back decoded or as
// one code per element.
#pragma once

#include <cstdint>
#include <vector>

#include "gradkit/ops/low_bit.h"
#include "support/test_tensor.h"

namespace gradkit::test {

// The code table of exp_avg (first) or exp_avg_sq.
inline QuantCode moment_code(bool first) { return first ? QuantCode::signed_dynamic : QuantCode::unsigned_dynamic; }

struct LowBitMoments {
  int32_t bits;  // 8 or 4
  std::vector<int64_t> numel;
  std::vector<TestTensor> m, v, am, av;

  explicit LowBitMoments(int32_t moment_bits) : bits(moment_bits) {}

  // One more tensor, whose moments encode `m0` and `v0` (as many values as it has elements).
  void add_moments(Device device, const std::vector<double>& m0, const std::vector<double>& v0) {
    const auto n = static_cast<int64_t>(m0.size());
    numel.push_back(n);
    const int64_t bytes = (n + elements_per_code_byte(bits) - 1) / elements_per_code_byte(bits);
    const int64_t blocks = (n + quant_block_of(bits) - 1) / quant_block_of(bits);
    m.emplace_back(device, DType::u8, std::vector<double>(bytes, 0.0));
    v.emplace_back(device, DType::u8, std::vector<double>(bytes, 0.0));
    am.emplace_back(device, DType::f32, std::vector<double>(blocks, 0.0));
    av.emplace_back(device, DType::f32, std::vector<double>(blocks, 0.0));
    encode(true, TestTensor(device, DType::f32, m0), m.back(), am.back());
    encode(false, TestTensor(device, DType::f32, v0), v.back(), av.back());
  }
  void encode(bool first, const TestTensor& values, TestTensor& codes, TestTensor& absmax) const {
    if (bits == 4) quantize_blockwise4(moment_code(first), values.view(), codes.view(), absmax.view());
    else quantize_blockwise(moment_code(first), values.view(), codes.view(), absmax.view());
  }
  // Tensor i's m (first) or v as the codes stand for them.
  std::vector<double> decoded(size_t i, bool first) const {
    const TestTensor &codes = (first ? m : v)[i], &absmax = (first ? am : av)[i];
    TestTensor out(codes.view().device, DType::f32, std::vector<double>(numel[i], 0.0));
    if (bits == 4) dequantize_blockwise4(moment_code(first), codes.view(), absmax.view(), out.view());
    else dequantize_blockwise(moment_code(first), codes.view(), absmax.view(), out.view());
    return out.read();
  }
  // Tensor i's codes of m (first) or v, one per element (4-bit: unpacked, the
  // low nibble first).
  std::vector<double> codes(size_t i, bool first) const {
    const std::vector<double> stored = (first ? m : v)[i].read();
    if (bits == 8) return stored;
    std::vector<double> out(static_cast<size_t>(numel[i]));
    for (size_t e = 0; e < out.size(); ++e) out[e] = (static_cast<int>(stored[e / 2]) >> ((e & 1) * 4)) & 0x0f;
    return out;
  }
  int64_t block() const { return quant_block_of(bits); }
};

}  // namespace gradkit::test
