// The owning Adam optimizer: step counter, learning rates, save/load.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/state_file.h"
#include "support/adam_reference.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/state_file_bytes.h"
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

// Files that get past the checksum (hand-made, as an attacker's would be),
// each refused with a message naming its fault, nothing loaded.
class HandMadeAdamFile {
 public:
  HandMadeAdamFile(Device device, const std::string& name) : model_(device, 11), adam_(model_.groups()), path_(temp_path(name)) {
    adam_.step();
    adam_.save(path_);
    sections = read_raw_sections(path_);
    adam_.step();  // the optimizer's state now differs from the file's
  }
  ~HandMadeAdamFile() { std::remove(path_.c_str()); }
  // Writes `sections` and expects load to refuse them with `fragment`.
  void expect_refused(const std::string& fragment) {
    write_raw_state_file(path_, sections);
    expect_load_refused(adam_, path_, fragment);
  }
  std::vector<RawSection> sections;

 private:
  Model model_;
  Adam adam_;
  std::string path_;
};

// Offsets in the 'groups' section: u32 group count, then group 0's
// hyperparameters (f32 lr, beta1, ...: 27 bytes), its u32 tensor count, and
// its first tensor's i64 count and u32 dtype.
constexpr size_t kBeta1 = 8, kFirstTensorDtype = 4 + 27 + 4 + 8;

TEST_P(AdamOptimizer, RefusesARepeatedSectionNamingIt) {
  HandMadeAdamFile file(device(), "adam_repeated");
  // A second exp_avg after max_exp_avg_sq: which copy a reader took would be
  // an accident of its code.
  std::vector<RawSection>& s = file.sections;
  RawSection second = find_section(s, "exp_avg");
  std::fill(second.bytes.begin(), second.bytes.end(), uint8_t{0x3f});
  auto after = std::find_if(s.begin(), s.end(), [](const RawSection& r) { return r.name == "max_exp_avg_sq"; });
  s.insert(after + 1, second);
  file.expect_refused("has section 'exp_avg' more than once");
}

TEST_P(AdamOptimizer, RefusesABadStepCountNamingIt) {
  HandMadeAdamFile file(device(), "adam_step");
  std::vector<uint8_t>& meta = find_section(file.sections, "meta").bytes;
  put_at<int64_t>(meta, 0, -5);  // was refused as "moments of dtype f32, expected f32"
  file.expect_refused("has step count -5 in section 'meta', expected 0 to 2^63 - 2");
  put_at<int64_t>(meta, 0, std::numeric_limits<int64_t>::max());  // the next step could not count it
  file.expect_refused("has step count 9223372036854775807");
}

TEST_P(AdamOptimizer, RefusesDtypeCodesThatAreNoDtype) {
  // 256 and 0 (f32) share their low byte: a cast to DType accepted 256 as f32.
  HandMadeAdamFile file(device(), "adam_dtype");
  std::vector<uint8_t>& meta = find_section(file.sections, "meta").bytes;
  put_at<uint32_t>(meta, 8, 256);
  file.expect_refused("has moments of dtype unknown dtype code 256, expected f32");
  put_at<uint32_t>(meta, 8, 0);
  put_at<uint32_t>(find_section(file.sections, "groups").bytes, kFirstTensorDtype, 256);
  file.expect_refused("groups[0] tensor 0 is 3000 elements of unknown dtype code 256, expected 3000 of f32");
}

TEST_P(AdamOptimizer, RefusesBadHyperparametersAsAnIoErrorNamingTheFile) {
  // Found by fuzz/state_file_fuzzer.cc: this was an invalid_argument naming
  // no file.
  HandMadeAdamFile file(device(), "adam_beta1");
  put_at<float>(find_section(file.sections, "groups").bytes, kBeta1, 1.8f);
  file.expect_refused("has bad hyperparameters: Adam: argument 'groups[0].beta1' is 1.79999995, expected a value in [0, 1)");
}

TEST_P(AdamOptimizer, RefusesTrailingBytesAndUnprintableNames) {
  HandMadeAdamFile file(device(), "adam_framing");
  find_section(file.sections, "meta").bytes.push_back(0);
  file.expect_refused("section 'meta' has trailing bytes");
  find_section(file.sections, "meta").bytes.pop_back();
  // Names and kinds go into messages that are printed: none with control
  // bytes (an escape sequence that clears the terminal, here).
  find_section(file.sections, "exp_avg").name = "exp\x1b[2J";
  file.expect_refused("has a section name that is not 1 to 64 printable ASCII characters (7 bytes)");
  find_section(file.sections, "exp\x1b[2J").name = "exp_avg";
  find_section(file.sections, "kind").bytes = {'a', 'd', 0x1b, 'm'};
  file.expect_refused("holds an unknown kind of state, expected 'adam'");
}

TEST(StateFile, AddRefusesWhatReadWouldRefuse) {
  StateFile file;
  file.add("meta", {1, 2});
  expect_error([&] { file.add("meta", {3}); }, ErrorCode::invalid_argument, {"section 'meta' is already in the file"});
  expect_error([&] { file.add("", {}); }, ErrorCode::invalid_argument, {"printable ASCII"});
  expect_error([&] { file.add("a b", {}); }, ErrorCode::invalid_argument, {"'a b'", "printable ASCII"});
  expect_error([&] { file.add(std::string(65, 'x'), {}); }, ErrorCode::invalid_argument, {"1 to 64"});
  EXPECT_EQ(file.get("meta"), (std::vector<uint8_t>{1, 2}));
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
