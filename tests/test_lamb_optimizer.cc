// The owning LAMB optimizer: counting, the reference, found_inf, save/load.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/lamb_reference.h"
#include "support/state_file_bytes.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

struct Model {
  std::vector<TestTensor> params, grads;
  Model(Device device, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n : {2000, 70000, 5}) {
      params.emplace_back(device, DType::f32, random_values(rng, n));
      grads.emplace_back(device, DType::f32, random_values(rng, n));
    }
  }
  std::vector<LambGroup> groups() const {
    LambGroup a, b;
    a.hyperparameters.lambda = 0.01f;
    b.hyperparameters.ratio_max = 0.3f;
    for (size_t i = 0; i < params.size(); ++i) {
      LambGroup& g = i == 1 ? b : a;
      g.params.push_back(params[i].view());
      g.grads.push_back(grads[i].view());
    }
    return {a, b};
  }
  std::vector<std::vector<double>> new_gradients(Device device, std::mt19937_64& rng) {
    std::vector<std::vector<double>> out;
    for (auto& g : grads) {
      out.push_back(round_to(DType::f32, random_values(rng, g.numel())));
      const auto bytes = TestTensor(device, DType::f32, out.back()).bytes();
      copy_from_host(g.view().data, device, bytes.data(), bytes.size());
    }
    return out;
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& p : params) out.push_back(p.bytes());
    return out;
  }
};

using LambOptimizer = OnEachDevice;

TEST_P(LambOptimizer, StepsCountAndMatchTheReference) {
  Model model(device(), 1);
  Lamb lamb(model.groups(), LambOptions{.eta = 0.01f});
  const auto groups = model.groups();
  std::vector<LambReferenceState> ref;
  for (const auto& p : model.params) {
    ref.push_back({p.read(), std::vector<double>(p.numel(), 0.0), std::vector<double>(p.numel(), 0.0), {}});
  }
  std::mt19937_64 rng(2);
  for (int step = 1; step <= 5; ++step) {
    const auto grads = model.new_gradients(device(), rng);
    lamb.step({}, {.loss_scale = 8.0f});
    LambReferenceInputs in;
    in.eta = 0.01;
    in.loss_scale = 8;
    in.step = step;
    for (size_t i = 0; i < ref.size(); ++i) {
      reference_lamb_step(ref[i], grads[i], groups[i == 1 ? 1 : 0].hyperparameters, in, DType::f32, DType::f32);
    }
  }
  EXPECT_EQ(lamb.step_count(), 5);
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_LE(relative_error(model.params[i].read(), ref[i].w), optimizer_tolerance(DType::f32, 5)) << i;
  }
}

TEST_P(LambOptimizer, FoundInfChangesNothing) {
  Model model(device(), 3);
  Lamb lamb(model.groups());
  lamb.step();
  const auto before = model.bits();
  TestFlag inf(device(), true);
  lamb.step({}, {.found_inf = inf.pointer()});
  EXPECT_EQ(model.bits(), before);
  EXPECT_EQ(lamb.step_count(), 1);
}

TEST_P(LambOptimizer, SaveLoadRoundTripsBitExactly) {
  Model model(device(), 4), resumed(device(), 4);
  Lamb lamb(model.groups(), LambOptions{.eta = 0.02f});
  std::mt19937_64 rng(5), rng_resumed(5);
  for (int s = 0; s < 3; ++s) {
    model.new_gradients(device(), rng);
    resumed.new_gradients(device(), rng_resumed);
    lamb.step();
  }
  const std::string path = temp_path("lamb_roundtrip");
  lamb.save(path);
  for (size_t i = 0; i < model.params.size(); ++i) {
    const auto bytes = model.params[i].bytes();
    copy_from_host(resumed.params[i].view().data, device(), bytes.data(), bytes.size());
  }
  for (int s = 0; s < 2; ++s) {
    model.new_gradients(device(), rng);
    lamb.step();
  }
  Lamb second(resumed.groups());  // default eta: the file brings 0.02
  second.load(path);
  EXPECT_EQ(second.step_count(), 3);
  EXPECT_EQ(second.eta(), 0.02f);
  for (int s = 0; s < 2; ++s) {
    resumed.new_gradients(device(), rng_resumed);
    second.step();
  }
  EXPECT_EQ(resumed.bits(), model.bits());
  std::remove(path.c_str());
}

TEST_P(LambOptimizer, RefusesAnAdamFile) {
  Model model(device(), 6);
  AdamGroup g;
  g.params = {model.params[0].view()};
  g.grads = {model.grads[0].view()};
  Adam adam({g});
  const std::string path = temp_path("adam_for_lamb");
  adam.save(path);
  Lamb lamb(model.groups());
  try {
    lamb.load(path);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error);
    EXPECT_NE(std::string(e.what()).find("holds 'adam' state, expected 'lamb'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(lamb.step_count(), 0);
  std::remove(path.c_str());
}

// A hand-made 'meta' section behind a valid checksum: each bad field is
// refused by name, nothing loaded.
TEST_P(LambOptimizer, RefusesABadMetaSectionNamingTheField) {
  Model model(device(), 7);
  Lamb lamb(model.groups(), LambOptions{.eta = 0.02f});
  lamb.step();
  const std::string path = temp_path("lamb_meta");
  lamb.save(path);
  lamb.step();
  std::vector<RawSection> sections = read_raw_sections(path);
  std::vector<uint8_t>& meta = find_section(sections, "meta").bytes;  // i64 steps, u32 moment dtype, f32 eta
  const std::vector<uint8_t> good = meta;
  auto expect_refused = [&](const std::string& fragment) {
    write_raw_state_file(path, sections);
    const auto before = model.bits();
    expect_error([&] { lamb.load(path); }, ErrorCode::io_error, {path, fragment});
    EXPECT_EQ(lamb.step_count(), 2);
    EXPECT_EQ(lamb.eta(), 0.02f);
    EXPECT_EQ(model.bits(), before);
    meta = good;
  };
  put_at<int64_t>(meta, 0, -5);
  expect_refused("has step count -5 in section 'meta', expected 0 to 2^63 - 2");
  // The largest count passed the old check, and the load's count + 1 overflowed.
  put_at<int64_t>(meta, 0, std::numeric_limits<int64_t>::max());
  expect_refused("has step count 9223372036854775807");
  put_at<uint32_t>(meta, 8, 2);
  expect_refused("has moments of dtype bf16, expected f32");
  put_at<float>(meta, 12, NAN);
  expect_refused("section 'meta' has a bad eta: Lamb: argument 'eta' is nan, expected a finite value >= 0");
  std::remove(path.c_str());
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(LambOptimizer);

}  // namespace
}  // namespace gradkit::test
