// What the tests of 8-bit moments share (Adam's and LAMB's): seeded moments
// that span decades, the views of a list of test tensors, the bytes of
// device tensors, and the check of one encoded moment against the float64
// reference (absmax to f32 rounding, each code the nearest or a neighbour).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/ops/low_bit.h"
#include "support/low_bit_reference.h"
#include "support/test_tensor.h"

namespace gradkit::test {

inline std::vector<TensorView> views(const std::vector<TestTensor>& ts) {
  std::vector<TensorView> out;
  for (const auto& t : ts) out.push_back(t.view());
  return out;
}

// Moments as an optimizer's span decades (10^lowest_decade .. 1 times 1e-2):
// m signed, v m^2-like (>= 0). Rounded to f32.
inline std::vector<double> moment_values(std::mt19937_64& rng, int64_t n, bool is_signed, int lowest_decade) {
  std::vector<double> x = random_values(rng, n, 1e-2);
  std::uniform_int_distribution<int> decade(lowest_decade, 0);
  for (double& v : x) {
    v *= std::pow(10.0, decade(rng));
    if (!is_signed) v = v * v;
  }
  return round_to(DType::f32, x);
}

// Every tensor's bytes, list after list (tensors on any device).
inline std::vector<std::vector<uint8_t>> device_bytes(std::initializer_list<const std::vector<TensorView>*> lists) {
  std::vector<std::vector<uint8_t>> out;
  for (const auto* list : lists) {
    for (const TensorView& t : *list) {
      std::vector<uint8_t> bytes(t.bytes());
      copy_to_host(bytes.data(), t.data, t.bytes(), t.device);
      out.push_back(bytes);
    }
  }
  return out;
}

// The kernel's encoding of `want` (the reference's new moment: exp_avg
// when `first`): each block's absmax agrees to f32 rounding, each code is
// the reference's or a neighbour (f32 arithmetic may land on the other side
// of a decision point).
// `codes` one per element; `bits` 8 (tables of 256, blocks of kQuantBlock,
// the unsigned map's positive floor) or 4 (tables of 16, blocks of
// kQuant4Block, no zero in the second moment's map).
inline void expect_encoded(const std::vector<double>& want, const std::vector<double>& codes,
                           const std::vector<double>& absmax, bool first, const std::string& what, int bits = 8) {
  const std::vector<double> table = bits == 4 ? reference_code4(first) : reference_code(first);
  const size_t block = bits == 4 ? kQuant4Block : kQuantBlock;
  for (size_t b = 0; b < absmax.size(); ++b) {
    const size_t end = std::min(want.size(), (b + 1) * block);
    const double want_absmax = block_absmax(want, b * block, end);
    ASSERT_NEAR(absmax[b], want_absmax, 8 * 0x1p-24 * want_absmax) << what << " block " << b;
    for (size_t k = b * block; k < end; ++k) {
      const int expected =
          want_absmax == 0 ? 0 : nearest_code(table, want[k] / want_absmax, bits == 8 && !first).index;
      ASSERT_LE(std::abs(static_cast<int>(codes[k]) - expected), 1)
          << what << (first ? " exp_avg" : " exp_avg_sq") << " element " << k;
    }
  }
}

// The instances of a low-bit test: each device with 8- and 4-bit moments, and
// their names (cpu_8bit, cuda_4bit, ...; a bits-only test's: 8bit, 4bit).
inline auto devices_and_bits() {
  return ::testing::Combine(::testing::Values(Device::cpu(), Device::cuda(0)), ::testing::Values(8, 4));
}
inline std::string low_bit_test_name(const ::testing::TestParamInfo<std::tuple<Device, int>>& info) {
  return std::string(std::get<0>(info.param).is_cuda() ? "cuda" : "cpu") + "_" +
         std::to_string(std::get<1>(info.param)) + "bit";
}
inline std::string bits_test_name(const ::testing::TestParamInfo<int>& info) {
  return std::to_string(info.param) + "bit";
}

// A model for the owning optimizers: f32 weights, bf16 gradients.
struct OwningModel {
  std::vector<TestTensor> w, g;
  OwningModel(Device device, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n : {3000, 64, 70001, 10}) {
      w.emplace_back(device, DType::f32, random_values(rng, n));
      g.emplace_back(device, DType::bf16, random_values(rng, n));
    }
  }
  // One group over every tensor, with `group`'s hyperparameters.
  template <class Group>
  std::vector<Group> groups(Group group) const {
    for (size_t i = 0; i < w.size(); ++i) {
      group.params.push_back(w[i].view());
      group.grads.push_back(g[i].view());
    }
    return {group};
  }
  void new_gradients(std::mt19937_64& rng) {
    for (auto& t : g) {
      const TestTensor fresh(t.view().device, DType::bf16, random_values(rng, t.numel()));
      copy_from_host(t.view().data, t.view().device, fresh.bytes().data(), fresh.bytes().size());
    }
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& t : w) out.push_back(t.bytes());
    return out;
  }
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& t : w) n += t.numel();
    return n;
  }
};

template <class Optimizer>
std::vector<std::vector<uint8_t>> moment_state(const Optimizer& o) {
  return device_bytes({&o.exp_avg(), &o.exp_avg_sq(), &o.exp_avg_absmax(), &o.exp_avg_sq_absmax()});
}

// What an owning optimizer's low-bit state holds for OwningModel's third
// tensor (70001 elements): 8-bit moments by default; 4-bit:
// {1.11, quant4_bytes(70001), quant4_blocks(70001)}.
struct LowBitSizes {
  double max_bytes_per_param = 2.1;  // OwningModel's small tensors' alignment included
  int64_t codes = 70001;
  int64_t blocks = quant_blocks(70001);
};

// An owning optimizer (Adam or Lamb) with 8- or 4-bit moments: about 2 (or
// 1) bytes of state per parameter; 3 steps, saved, 4 more; a second
// optimizer loads the file and takes the same 4 steps: the same weights and
// state, bit for bit; an f32-moment optimizer refuses the file.
template <class Optimizer>
void expect_resumed_run_equals_straight_run(Device device, const typename Optimizer::Group& group,
                                            const typename Optimizer::Options& options, LowBitSizes sizes = {}) {
  OwningModel straight(device, 5), resumed(device, 5);
  Optimizer first(straight.groups(group), options);
  EXPECT_LE(static_cast<double>(first.state_bytes()) / straight.numel(), sizes.max_bytes_per_param)
      << "bytes of state per parameter";
  EXPECT_EQ(first.exp_avg()[2].dtype, DType::u8);
  EXPECT_EQ(first.exp_avg()[2].numel, sizes.codes);
  EXPECT_EQ(first.exp_avg_absmax()[2].numel, sizes.blocks);
  std::mt19937_64 rng(6);
  for (int s = 0; s < 3; ++s) {
    straight.new_gradients(rng);
    first.step();
  }
  const std::string path = ::testing::TempDir() + "gradkit_8bit_resume_" + std::to_string(::getpid());
  first.save(path);
  for (size_t i = 0; i < straight.w.size(); ++i) {
    copy_from_host(resumed.w[i].view().data, device, straight.w[i].bytes().data(), straight.w[i].bytes().size());
  }
  std::mt19937_64 rng_resumed = rng;
  for (int s = 0; s < 4; ++s) {
    straight.new_gradients(rng);
    first.step();
  }
  Optimizer second(resumed.groups(group), options);
  second.load(path);
  EXPECT_EQ(second.step_count(), 3);
  for (int s = 0; s < 4; ++s) {
    resumed.new_gradients(rng_resumed);
    second.step();
  }
  EXPECT_EQ(resumed.bits(), straight.bits());
  EXPECT_EQ(moment_state(second), moment_state(first));
  Optimizer f32(resumed.groups(group));  // f32 moments: the 8-bit file is refused
  EXPECT_THROW(f32.load(path), Error);
  std::remove(path.c_str());
}

}  // namespace gradkit::test
