// The remainder master: a bf16 weight plus an i16 remainder gives back its
// f32 master bit for bit (every bf16 pattern times a sample of remainders),
// the weight is the master rounded to nearest with ties away from zero, and
// Adam over (weight, remainder) keeps exactly the masters the f32-master
// path keeps, step after step.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/master.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/master_weights.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

// The bf16 nearest to the f32 `bits`, ties away from zero, found in f64 from
// the two bf16 values around it (the one toward zero by truncation, the next
// one out; 0x7f80 stands for 2^128 when it is Inf).
uint16_t reference_round_away(uint32_t bits) {
  const uint32_t sign = bits & 0x80000000u, magnitude = bits & 0x7fffffffu;
  const uint32_t low = magnitude >> 16, high = low + 1;
  auto value = [](uint32_t b16) {
    return b16 == 0x7f80u ? std::ldexp(1.0, 128) : static_cast<double>(std::bit_cast<float>(b16 << 16));
  };
  const double x = std::bit_cast<float>(magnitude);
  const double below = x - value(low), above = value(high) - x;
  const uint32_t pick = above <= below ? high : low;
  return static_cast<uint16_t>((sign >> 16) | pick);
}

template <class T>
std::vector<T> as(const std::vector<uint8_t>& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

TEST(RemainderMaster, EveryBf16PatternTimesSampledRemaindersRoundTrips) {
  std::vector<int32_t> remainders = {-32768, -32767, -16384, -1, 0, 1, 16384, 32767};
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int32_t> any(-32768, 32767);
  while (remainders.size() < 72) remainders.push_back(any(rng));
  std::vector<float> masters(65536);
  Buffer m(Device::cpu(), 65536 * 4), w(Device::cpu(), 65536 * 2), r(Device::cpu(), 65536 * 2), back(Device::cpu(), 65536 * 4);
  for (int32_t rem : remainders) {
    for (uint32_t high = 0; high < 65536; ++high) masters[high] = std::bit_cast<float>((high << 16) + static_cast<uint32_t>(rem));
    std::memcpy(m.data(), masters.data(), masters.size() * 4);
    split_masters(m.view(DType::f32, 0, 65536), w.view(DType::bf16, 0, 65536), r.view(DType::i16, 0, 65536));
    join_masters(w.view(DType::bf16, 0, 65536), r.view(DType::i16, 0, 65536), back.view(DType::f32, 0, 65536));
    const auto* weights = static_cast<const uint16_t*>(w.data());
    const auto* got = static_cast<const uint32_t*>(back.data());
    for (uint32_t high = 0; high < 65536; ++high) {
      const uint32_t bits = std::bit_cast<uint32_t>(masters[high]);
      if (std::isnan(masters[high])) {
        ASSERT_TRUE(std::isnan(std::bit_cast<float>(got[high]))) << std::hex << bits;
        ASSERT_TRUE(std::isnan(std::bit_cast<float>(static_cast<uint32_t>(weights[high]) << 16))) << std::hex << bits;
        continue;
      }
      ASSERT_EQ(got[high], bits) << std::hex << "master " << bits << " weight " << weights[high];
      ASSERT_EQ(weights[high], reference_round_away(bits)) << std::hex << "master " << bits;
      // Round to nearest even (the f32-master path's model copy) differs only on an exact tie.
      if ((bits & 0xffffu) != 0x8000u) ASSERT_EQ(weights[high], bfloat16(masters[high]).bits) << std::hex << bits;
    }
  }
}

TEST(RemainderMaster, ConversionsRejectBadArguments) {
  TestTensor m(Device::cpu(), DType::f32, {1, 2}), w(Device::cpu(), DType::bf16, {0, 0}), r(Device::cpu(), DType::i16, {0, 0});
  TestTensor short_r(Device::cpu(), DType::i16, {0}), f16(Device::cpu(), DType::f16, {0, 0});
  const auto before = w.bytes();
  expect_error([&] { split_masters(m.view(), w.view(), short_r.view()); }, ErrorCode::size_mismatch, {"remainder", "expected 2"});
  expect_error([&] { split_masters(m.view(), f16.view(), r.view()); }, ErrorCode::dtype_unsupported, {"weights", "bf16"});
  expect_error([&] { join_masters(w.view(), m.view(), m.view()); }, ErrorCode::dtype_unsupported, {"remainder", "i16"});
  EXPECT_EQ(w.bytes(), before);
}

std::vector<TensorView> views(const std::vector<TestTensor>& ts) {
  std::vector<TensorView> out;
  for (const auto& t : ts) out.push_back(t.view());
  return out;
}

// One optimizer's tensors for a list of sizes: the weights in either form
// (support/master_weights.h), moments f32 or u8.
struct State : MasterWeights {
  std::vector<TestTensor> m, v, am, av;
  State(Device device, const std::vector<std::vector<double>>& masters, bool remainder, DType moments)
      : MasterWeights(device, masters, remainder) {
    for (const auto& x : masters) {
      const auto n = static_cast<int64_t>(x.size());
      m.emplace_back(device, moments, std::vector<double>(x.size(), moments == DType::u8 ? 127.0 : 0.0));
      v.emplace_back(device, moments, std::vector<double>(x.size(), 0.0));
      am.emplace_back(device, DType::f32, std::vector<double>(quant_blocks(n), 0.0));
      av.emplace_back(device, DType::f32, std::vector<double>(quant_blocks(n), 0.0));
    }
  }
  // Every tensor's f32 master bits, one after another.
  std::vector<uint32_t> masters() const {
    std::vector<uint32_t> out;
    for (size_t i = 0; i < w.size(); ++i) {
      const auto bits = master_bits(i);
      out.insert(out.end(), bits.begin(), bits.end());
    }
    return out;
  }
};

using RemainderAdam = OnEachDevice;

// Same masters, same gradients: the (weight, remainder) path keeps the f32
// path's masters and moments bit for bit over 100 steps; its weights are
// the masters rounded to nearest with ties away from zero, the f32 path's
// copy the same masters rounded to nearest even (they differ only on ties).
TEST_P(RemainderAdam, KeepsTheF32MasterPathsMastersBitForBitOver100Steps) {
  for (DType moments : {DType::f32, DType::u8}) {
    std::mt19937_64 rng(21);
    const std::vector<int64_t> sizes = {7, 65536 + 300, 1000, 13 * 256 + 5};  // the last: a part round (8-bit, CUDA)
    std::vector<std::vector<double>> init;
    for (int64_t n : sizes) init.push_back(round_to(DType::f32, random_values(rng, n, 0.1)));
    State f32(device(), init, false, moments), pair(device(), init, true, moments);
    AdamHyperparameters h;
    h.lr = 1e-3f;
    h.weight_decay = 0.01f;
    const auto fw = views(f32.w), fc = views(f32.copy), fm = views(f32.m), fv = views(f32.v), fam = views(f32.am),
               fav = views(f32.av);
    const auto pw = views(pair.w), pr = views(pair.rem), pm = views(pair.m), pv = views(pair.v), pam = views(pair.am),
               pav = views(pair.av);
    std::vector<TestTensor> g;
    for (int64_t n : sizes) g.emplace_back(device(), DType::bf16, std::vector<double>(n, 0.5));
    const auto gv = views(g);
    AdamTensors a{fw, gv, fm, fv, {}, fc}, b{pw, gv, pm, pv, {}, {}};
    if (moments == DType::u8) {
      a.exp_avg_absmax = fam;
      a.exp_avg_sq_absmax = fav;
      b.exp_avg_absmax = pam;
      b.exp_avg_sq_absmax = pav;
    }
    b.weight_remainder = pr;
    const AdamPlan plan_a(a, std::span(&h, 1)), plan_b(b, std::span(&h, 1));
    for (int step = 1; step <= 100; ++step) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        const auto grad = round_to(DType::bf16, random_values(rng, sizes[i]));
        const TestTensor fresh(device(), DType::bf16, grad);
        copy_from_host(g[i].view().data, device(), fresh.bytes().data(), fresh.bytes().size());
      }
      plan_a.step({.step = step});
      plan_b.step({.step = step});
      synchronize(device());
      const std::vector<uint32_t> ma = f32.masters(), mb = pair.masters();
      ASSERT_EQ(ma, mb) << dtype_name(moments) << " moments, step " << step;
      for (size_t i = 0; i < sizes.size(); ++i) {
        ASSERT_EQ(f32.m[i].bytes(), pair.m[i].bytes()) << "exp_avg, step " << step;
        ASSERT_EQ(f32.v[i].bytes(), pair.v[i].bytes()) << "exp_avg_sq, step " << step;
        const auto copy = as<uint16_t>(f32.copy[i].bytes()), weights = as<uint16_t>(pair.w[i].bytes());
        const auto master = as<uint32_t>(f32.w[i].bytes());
        for (size_t k = 0; k < copy.size(); ++k) {
          if ((master[k] & 0xffffu) == 0x8000u) ASSERT_EQ(weights[k], reference_round_away(master[k]));
          else ASSERT_EQ(weights[k], copy[k]) << "element " << k << ", step " << step;
        }
      }
    }
  }
}

TEST_P(RemainderAdam, RejectsCombinationsThatCannotWork) {
  TestTensor w32(device(), DType::f32, {1, 2}), w16(device(), DType::bf16, {1, 2}), wh(device(), DType::f16, {1, 2});
  TestTensor g(device(), DType::f32, {1, 1}), m(device(), DType::f32, {0, 0}), v(device(), DType::f32, {0, 0});
  TestTensor r(device(), DType::i16, {0, 0}), r32(device(), DType::f32, {0, 0}), copy(device(), DType::bf16, {0, 0});
  const TensorView W32[] = {w32.view()}, W16[] = {w16.view()}, WH[] = {wh.view()}, G[] = {g.view()}, M[] = {m.view()},
                   V[] = {v.view()}, R[] = {r.view()}, R32[] = {r32.view()}, C[] = {copy.view()};
  const AdamHyperparameters h;
  auto plan = [&](AdamTensors t) { AdamPlan(t, std::span(&h, 1)); };
  expect_error([&] { plan({W32, G, M, V, {}, {}, {}, {}, R}); }, ErrorCode::dtype_unsupported, {"weights", "bf16"});
  expect_error([&] { plan({WH, G, M, V, {}, {}, {}, {}, R}); }, ErrorCode::dtype_unsupported, {"weights", "bf16"});
  expect_error([&] { plan({W16, G, M, V, {}, {}, {}, {}, {}}); }, ErrorCode::dtype_unsupported,
               {"weights", "bf16 with weight_remainder"});
  expect_error([&] { plan({W16, G, M, V, {}, C, {}, {}, R}); }, ErrorCode::invalid_argument, {"model_copy", "weight_remainder"});
  expect_error([&] { plan({W16, G, M, V, {}, {}, {}, {}, R32}); }, ErrorCode::dtype_unsupported, {"weight_remainder"});
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(RemainderAdam);

}  // namespace
}  // namespace gradkit::test
