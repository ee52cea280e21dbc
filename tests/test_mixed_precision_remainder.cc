// MixedPrecision<Adam> and MixedPrecision<Lamb> with remainder masters
// (MasterStorage::remainder): the master (weight, remainder) is the
// f32-master path's master bit for bit over 100 steps with overflows and
// clipping, the weights differ only on ties, state files load across the
// two ways of keeping the masters, and what cannot work is refused naming
// the argument.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/master.h"
#include "gradkit/optim/mixed_precision.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

const std::vector<int64_t> kSizes = {3000, 65536 + 100, 33};

struct Bf16Model {
  std::vector<TestTensor> params, grads;
  Bf16Model(Device device, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n : kSizes) {
      params.emplace_back(device, DType::bf16, random_values(rng, n));
      grads.emplace_back(device, DType::bf16, random_values(rng, n));
    }
  }
  template <class Group = AdamGroup>
  std::vector<Group> groups() const {
    Group g;
    if constexpr (std::is_same_v<Group, AdamGroup>) {
      g.hyperparameters.lr = 1e-2f;
      g.hyperparameters.weight_decay = 0.01f;
    } else {
      g.hyperparameters.lambda = 0.01f;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      g.params.push_back(params[i].view());
      g.grads.push_back(grads[i].view());
    }
    return {g};
  }
  // Scaled gradients, the same for every model fed from an equal rng.
  void set_gradients(std::mt19937_64& rng, double scale, double poison) {
    for (size_t i = 0; i < grads.size(); ++i) {
      auto v = random_values(rng, grads[i].numel(), scale * 1e-3);
      if (i == 1 && poison != 0) v[777] = poison;
      const auto bytes = TestTensor(grads[i].view().device, DType::bf16, v).bytes();
      copy_from_host(grads[i].view().data, grads[i].view().device, bytes.data(), bytes.size());
    }
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& p : params) out.push_back(p.bytes());
    return out;
  }
};

std::vector<uint32_t> bits_of(const TensorView& t) {
  std::vector<uint32_t> out(static_cast<size_t>(t.numel));
  copy_to_host(out.data(), t.data, t.bytes(), t.device);
  return out;
}

// The remainder optimizer's masters, joined.
template <class Optimizer>
std::vector<uint32_t> joined(const MixedPrecision<Optimizer>& opt, const Bf16Model& model, size_t i) {
  TestTensor out(model.params[i].view().device, DType::f32, std::vector<double>(model.params[i].numel(), 0.0));
  join_masters(model.params[i].view(), opt.weight_remainders()[i], out.view());
  return bits_of(out.view());
}

// bf16 of an f32 bit pattern rounded to nearest, ties to even (the f32 path's cast).
uint16_t round_even(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

using RemainderMaster = OnEachDevice;

// 100 steps with Inf, NaN and overflowing gradients, clipping and a dynamic
// scale, with moments of dtype `moments`: the same steps are skipped and the
// masters agree bit for bit after every step. The model's weights are the
// f32 path's (round to nearest even) except where a master's low 16 bits
// are exactly 0x8000 (a tie, rounded away from zero instead).
template <class Optimizer>
void expect_f32_masters_over_100_steps(Device device, DType moments) {
  using Group = typename Optimizer::Group;
  typename Optimizer::Options optimizer_options;
  optimizer_options.moment_dtype = moments;
  if constexpr (std::is_same_v<Optimizer, Lamb>) optimizer_options.eta = 1e-2f;
  Bf16Model f32_model(device, 5), rem_model(device, 5);
  MixedPrecisionOptions options;
  options.scaler.initial_scale = 1024.0f;
  options.scaler.growth_interval = 8;
  options.max_norm = 1.0f;
  MixedPrecision<Optimizer> f32(f32_model.groups<Group>(), options, optimizer_options);
  options.master = MasterStorage::remainder;
  MixedPrecision<Optimizer> rem(rem_model.groups<Group>(), options, optimizer_options);
  EXPECT_TRUE(rem.masters().empty());
  EXPECT_LT(rem.master_bytes(), f32.master_bytes() / 2 + 1024) << "2 bytes per parameter, not 4";
  std::mt19937_64 ra(6), rb(6);
  for (int step = 0; step < 100; ++step) {
    const double poison = step == 5 ? INFINITY : step == 40 ? NAN : step == 41 ? 1e30 : 0.0;  // 1e30: clipped
    f32_model.set_gradients(ra, f32.loss_scale(), poison);
    rem_model.set_gradients(rb, rem.loss_scale(), poison);
    f32.step();
    rem.step();
    ASSERT_EQ(rem.last_step_skipped(), f32.last_step_skipped()) << step;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      const std::vector<uint32_t> want = bits_of(f32.masters()[i]), got = joined(rem, rem_model, i);
      ASSERT_EQ(got, want) << dtype_name(moments) << " step " << step << " tensor " << i;
      if (step % 20 != 19) continue;
      std::vector<uint16_t> weights(want.size());
      copy_to_host(weights.data(), rem_model.params[i].view().data, weights.size() * 2, device);
      for (size_t k = 0; k < want.size(); ++k) {
        const bool tie = (want[k] & 0xffffu) == 0x8000u;
        if (!tie) ASSERT_EQ(weights[k], round_even(want[k])) << "element " << k;
        else ASSERT_EQ(weights[k], static_cast<uint16_t>((want[k] + 0x8000u) >> 16)) << "a tie, away from zero";
      }
    }
  }
  EXPECT_EQ(rem.optimizer().step_count(), f32.optimizer().step_count());
  EXPECT_GE(rem.optimizer().step_count(), 97) << "three steps overflow, none other";
  EXPECT_EQ(rem.loss_scale(), f32.loss_scale());
}

TEST_P(RemainderMaster, EqualsTheF32MasterBitForBitOver100Steps) {
  for (DType moments : {DType::f32, DType::u8}) expect_f32_masters_over_100_steps<Adam>(device(), moments);
}

// LAMB takes float moments with remainder masters (f32 and bf16).
TEST_P(RemainderMaster, LambEqualsTheF32MasterBitForBitOver100Steps) {
  for (DType moments : {DType::f32, DType::bf16}) expect_f32_masters_over_100_steps<Lamb>(device(), moments);
}

// A file saved with remainder masters loads into an f32-master optimizer
// and back (the file holds the f32 masters either way); resuming equals the
// straight run.
template <class Optimizer>
void expect_state_files_load_across_master_storage(Device device) {
  using Group = typename Optimizer::Group;
  MixedPrecisionOptions rem_options;
  rem_options.master = MasterStorage::remainder;
  Bf16Model straight(device, 9), as_f32(device, 10), back(device, 11);
  MixedPrecision<Optimizer> a(straight.groups<Group>(), rem_options);
  std::mt19937_64 rng(12);
  for (int s = 0; s < 4; ++s) {
    straight.set_gradients(rng, a.loss_scale(), 0.0);
    a.step();
  }
  const std::string path = ::testing::TempDir() + "gradkit_mp_rem_" + std::to_string(::getpid());
  const std::string path2 = path + "_f32";
  a.save(path);
  MixedPrecision<Optimizer> b(as_f32.groups<Group>());  // f32 masters
  b.load(path);
  for (size_t i = 0; i < kSizes.size(); ++i) EXPECT_EQ(bits_of(b.masters()[i]), joined(a, straight, i)) << i;
  b.save(path2);
  MixedPrecision<Optimizer> c(back.groups<Group>(), rem_options);
  c.load(path2);
  EXPECT_EQ(back.bits(), straight.bits()) << "load writes the weights from the masters";
  for (size_t i = 0; i < kSizes.size(); ++i) EXPECT_EQ(joined(c, back, i), joined(a, straight, i)) << i;
  std::mt19937_64 rng_c = rng;
  for (int s = 0; s < 3; ++s) {
    straight.set_gradients(rng, a.loss_scale(), 0.0);
    back.set_gradients(rng_c, c.loss_scale(), 0.0);
    a.step();
    c.step();
  }
  EXPECT_EQ(back.bits(), straight.bits());
  for (size_t i = 0; i < kSizes.size(); ++i) EXPECT_EQ(joined(c, back, i), joined(a, straight, i)) << i;
  std::remove(path.c_str());
  std::remove(path2.c_str());
}

TEST_P(RemainderMaster, StateFilesLoadAcrossTheTwoWaysOfKeepingMasters) {
  expect_state_files_load_across_master_storage<Adam>(device());
}

TEST_P(RemainderMaster, LambStateFilesLoadAcrossTheTwoWaysOfKeepingMasters) {
  expect_state_files_load_across_master_storage<Lamb>(device());
}

TEST_P(RemainderMaster, RefusesWhatCannotWorkNamingIt) {
  MixedPrecisionOptions options;
  options.master = MasterStorage::remainder;
  TestTensor p16(device(), DType::f16, {1.0, 2.0}), g16(device(), DType::f16, {1.0, 2.0});
  AdamGroup half;
  half.params = {p16.view()};
  half.grads = {g16.view()};
  expect_error([&] { MixedPrecisionAdam({half}, options); }, ErrorCode::dtype_unsupported,
               {"groups[0].params[0]", "expected bf16", "remainder"});
  Bf16Model model(device(), 13);
  const auto before = model.bits();
  // LAMB's remainder master takes float moments only.
  expect_error([&] { MixedPrecisionLamb(model.groups<LambGroup>(), options, {.moment_dtype = DType::u8}); },
               ErrorCode::invalid_argument, {"options.moment_dtype", "u8 with weight_remainder", "f32 or bf16"});
  EXPECT_EQ(model.bits(), before);
  MixedPrecisionOptions bad;
  bad.master = static_cast<MasterStorage>(7);
  expect_error([&] { MixedPrecisionAdam(model.groups(), bad); }, ErrorCode::invalid_argument,
               {"options.master", "is 7", "f32 or remainder"});
  // The owning Adam: remainders for every param or none.
  TestTensor r(device(), DType::i16, std::vector<double>(kSizes[0], 0.0));
  std::vector<AdamGroup> groups = model.groups();
  groups[0].weight_remainder = {r.view()};
  expect_error([&] { Adam adam(groups); }, ErrorCode::size_mismatch, {"groups[0].weight_remainder", "expected 3"});
  // And the owning Lamb.
  std::vector<LambGroup> lamb_groups = model.groups<LambGroup>();
  lamb_groups[0].weight_remainder = {r.view()};
  expect_error([&] { Lamb lamb(lamb_groups); }, ErrorCode::size_mismatch, {"groups[0].weight_remainder", "expected 3"});
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(RemainderMaster);

}  // namespace
}  // namespace gradkit::test
