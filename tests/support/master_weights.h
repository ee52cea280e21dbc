// The weights of a test optimizer that keeps f32 masters, in either of the
// two ways (docs/ops.md, "the remainder master"): f32 weights with a bf16
// model copy, or bf16 weights with their i16 remainders split from the same
// masters. The remainder tests build one of each from the same values and
// compare their masters bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "gradkit/ops/master.h"
#include "support/test_tensor.h"

namespace gradkit::test {

struct MasterWeights {
  std::vector<TestTensor> w, copy, rem;  // copy: f32 form only; rem: remainder form only

  MasterWeights(Device device, const std::vector<std::vector<double>>& masters, bool remainder) {
    for (const auto& x : masters) {
      const std::vector<double> zeros(x.size(), 0.0);
      if (remainder) {
        const TestTensor master(device, DType::f32, x);
        w.emplace_back(device, DType::bf16, zeros);
        rem.emplace_back(device, DType::i16, zeros);
        split_masters(master.view(), w.back().view(), rem.back().view());
      } else {
        w.emplace_back(device, DType::f32, x);
        copy.emplace_back(device, DType::bf16, zeros);
      }
    }
  }

  // Tensor i's f32 master, as bits (joined from weight and remainder in the
  // remainder form).
  std::vector<uint32_t> master_bits(size_t i) const {
    std::vector<uint8_t> bytes;
    if (rem.empty()) {
      bytes = w[i].bytes();
    } else {
      const TestTensor joined(w[i].view().device, DType::f32, std::vector<double>(w[i].numel(), 0.0));
      join_masters(w[i].view(), rem[i].view(), joined.view());
      bytes = joined.bytes();
    }
    std::vector<uint32_t> out(bytes.size() / sizeof(uint32_t));
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }
};

}  // namespace gradkit::test
