// The owning Adam optimizer: step counter, learning rates, save/load.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/optim/adam.h"
#include "support/adam_reference.h"
#include "support/device_param.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

// A small model: two groups (decayed weights, undecayed biases) with f32
// masters, bf16 gradients and a bf16 model copy.
struct Model {
  std::vector<TestTensor> params, grads, copies;
  Model(Device device, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n : {3000, 64, 70001, 10}) {
      params.emplace_back(device, DType::f32, random_values(rng, n));
      grads.emplace_back(device, DType::bf16, random_values(rng, n));
      copies.emplace_back(device, DType::bf16, random_values(rng, n));
    }
  }
  std::vector<AdamGroup> groups() const {
    AdamGroup decayed, plain;
    decayed.hyperparameters.lr = 1e-2f;
    decayed.hyperparameters.weight_decay = 0.01f;
    plain.hyperparameters.lr = 2e-2f;
    plain.hyperparameters.amsgrad = true;
    for (size_t i = 0; i < params.size(); ++i) {
      AdamGroup& g = i % 2 == 0 ? decayed : plain;
      g.params.push_back(params[i].view());
      g.grads.push_back(grads[i].view());
      g.model_copy.push_back(copies[i].view());
    }
    return {decayed, plain};
  }
  void new_gradients(Device device, std::mt19937_64& rng) {
    for (auto& g : grads) {
      const auto values = random_values(rng, g.numel());
      copy_bits(g, TestTensor(device, DType::bf16, values));
    }
  }
  static void copy_bits(TestTensor& to, const TestTensor& from) {
    const auto bytes = from.bytes();
    copy_from_host(to.view().data, to.view().device, bytes.data(), bytes.size());
  }
  std::vector<std::vector<uint8_t>> weight_bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& p : params) out.push_back(p.bytes());
    for (const auto& c : copies) out.push_back(c.bytes());
    return out;
  }
};

std::vector<std::vector<uint8_t>> state_bits(const Adam& adam) {
  std::vector<std::vector<uint8_t>> out;
  for (const auto* list : {&adam.exp_avg(), &adam.exp_avg_sq(), &adam.max_exp_avg_sq()}) {
    for (const TensorView& t : *list) {
      std::vector<uint8_t> b(t.bytes());
      copy_to_host(b.data(), t.data, b.size(), t.device);
      out.push_back(b);
    }
  }
  return out;
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "gradkit_" + name + "_" + std::to_string(::getpid());
}

using AdamOptimizer = OnEachDevice;

TEST_P(AdamOptimizer, StepsCountAndMatchTheReference) {
  Model model(device(), 1);
  Adam adam(model.groups());
  const auto groups = model.groups();
  std::vector<AdamReferenceState> ref;
  for (const auto& p : model.params) ref.push_back({p.read(), std::vector<double>(p.numel(), 0.0),
                                                    std::vector<double>(p.numel(), 0.0), {}});
  std::mt19937_64 rng(2);
  for (int step = 1; step <= 10; ++step) {
    model.new_gradients(device(), rng);
    adam.step();
    for (size_t i = 0; i < ref.size(); ++i) {
      reference_adam_step(ref[i], model.grads[i].read(), groups[i % 2].hyperparameters, step, 1.0, DType::f32,
                          DType::f32);
    }
  }
  EXPECT_EQ(adam.step_count(), 10);
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_LE(relative_error(model.params[i].read(), ref[i].w), optimizer_tolerance(DType::f32, 10)) << i;
    EXPECT_EQ(model.copies[i].read(), round_to(DType::bf16, model.params[i].read())) << i;
  }
}

TEST_P(AdamOptimizer, FoundInfLeavesEverythingIncludingTheCounter) {
  Model model(device(), 3);
  Adam adam(model.groups());
  adam.step();
  const auto weights = model.weight_bits();
  const auto state = state_bits(adam);
  TestFlag found_inf(device(), true);
  adam.step({}, found_inf.pointer());
  EXPECT_EQ(adam.step_count(), 1);
  EXPECT_EQ(model.weight_bits(), weights);
  EXPECT_EQ(state_bits(adam), state);
}

TEST_P(AdamOptimizer, SetLrTakesEffectAndIsChecked) {
  Model a(device(), 4), b(device(), 4);
  Adam fast(a.groups()), slow(b.groups());
  slow.set_lr(0, 1e-5f);
  EXPECT_EQ(slow.lr(0), 1e-5f);
  EXPECT_EQ(slow.lr(1), 2e-2f);
  fast.step();
  slow.step();
  EXPECT_NE(a.params[0].bytes(), b.params[0].bytes());
  EXPECT_EQ(a.params[1].bytes(), b.params[1].bytes()) << "group 1 kept its lr";
  EXPECT_THROW(slow.set_lr(2, 1e-3f), Error);
  EXPECT_THROW(slow.set_lr(0, -1.0f), Error);
}

// Save after 3 steps, go on 2 more; a fresh optimizer that loads the file
// over the 3-step weights reaches the same 5-step weights and state, bit for bit.
TEST_P(AdamOptimizer, SaveLoadRoundTripsBitExactly) {
  Model model(device(), 5), resumed(device(), 5);
  Adam adam(model.groups());
  std::mt19937_64 rng(6), rng_resumed(6);
  for (int s = 0; s < 3; ++s) {
    model.new_gradients(device(), rng);
    resumed.new_gradients(device(), rng_resumed);
    adam.step();
  }
  const std::string path = temp_path("adam_roundtrip");
  adam.set_lr(1, 7e-3f);
  adam.save(path);
  for (size_t i = 0; i < model.params.size(); ++i) {
    Model::copy_bits(resumed.params[i], model.params[i]);
    Model::copy_bits(resumed.copies[i], model.copies[i]);
  }
  for (int s = 0; s < 2; ++s) {
    model.new_gradients(device(), rng);
    adam.step();
  }
  Adam second(resumed.groups());
  second.load(path);
  EXPECT_EQ(second.step_count(), 3);
  EXPECT_EQ(second.lr(1), 7e-3f);
  for (int s = 0; s < 2; ++s) {
    resumed.new_gradients(device(), rng_resumed);
    second.step();
  }
  EXPECT_EQ(resumed.weight_bits(), model.weight_bits());
  EXPECT_EQ(state_bits(second), state_bits(adam));
  std::remove(path.c_str());
}

void expect_load_refused(Adam& adam, const std::string& path, const std::string& fragment) {
  const auto before = state_bits(adam);
  const int64_t step = adam.step_count();
  try {
    adam.load(path);
    ADD_FAILURE() << "expected load to fail with " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
  EXPECT_EQ(state_bits(adam), before);
  EXPECT_EQ(adam.step_count(), step);
}

TEST_P(AdamOptimizer, CorruptOrMismatchedFilesAreRefusedWithoutWriting) {
  Model model(device(), 7);
  Adam adam(model.groups());
  adam.step();
  const std::string path = temp_path("adam_good");
  adam.save(path);
  adam.step();

  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto write = [&](const std::string& name, const std::vector<char>& content) {
    const std::string p = temp_path(name);
    std::ofstream(p, std::ios::binary).write(content.data(), static_cast<std::streamsize>(content.size()));
    return p;
  };
  std::vector<char> flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x10;
  expect_load_refused(adam, write("flipped", flipped), "checksum");
  expect_load_refused(adam, write("truncated", std::vector<char>(bytes.begin(), bytes.begin() + 100)), "");
  std::vector<char> wrong_magic = bytes;
  wrong_magic[0] = 'X';
  expect_load_refused(adam, write("magic", wrong_magic), "not a gradkit state file");
  expect_load_refused(adam, temp_path("missing"), "cannot be opened");

  // A file from an optimizer over other shapes.
  Model other(device(), 8);
  std::vector<AdamGroup> groups = other.groups();
  groups[0].params.pop_back();
  groups[0].grads.pop_back();
  groups[0].model_copy.pop_back();
  Adam smaller(groups);
  const std::string small_path = temp_path("adam_small");
  smaller.save(small_path);
  expect_load_refused(adam, small_path, "does not match this optimizer");
  for (const char* name : {"flipped", "truncated", "magic"}) std::remove(temp_path(name).c_str());
  std::remove(path.c_str());
  std::remove(small_path.c_str());
}

TEST_P(AdamOptimizer, RejectsBadGroups) {
  Model model(device(), 9);
  std::vector<AdamGroup> groups = model.groups();
  groups[1].grads.pop_back();
  EXPECT_THROW(Adam{groups}, Error);
  groups = model.groups();
  groups[1].model_copy.clear();
  try {
    Adam adam(groups);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'groups[1].model_copy'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Adam(std::vector<AdamGroup>{}), Error);
  EXPECT_THROW(Adam(model.groups(), AdamOptions{DType::f16}), Error);
}

GRADKIT_INSTANTIATE_ON_EACH_DEVICE(AdamOptimizer);

}  // namespace
}  // namespace gradkit::test
