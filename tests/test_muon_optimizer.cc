// The owning Muon optimizer: it steps as its MuonPlan does, counts steps
// (found_inf leaves the count and everything else), saves and loads
// bit-exactly, and refuses files and arguments that are not its own.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/muon.h"
#include "gradkit/optim/state_file.h"
#include "support/device_param.h"
#include "support/expect_error.h"
#include "support/state_file_bytes.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

const std::vector<MatrixShape> kShapes = {{1, 24, 40}, {3, 16, 24}, {1, 40, 24}};

struct Model {
  std::vector<TestTensor> params, grads;
  Model(Device device, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (const MatrixShape& s : kShapes) {
      const int64_t n = s.batch * s.rows * s.cols;
      params.emplace_back(device, DType::f32, random_values(rng, n));
      grads.emplace_back(device, DType::f32, random_values(rng, n));
    }
  }
  // Two groups: the first and last tensors, and the stack with another lr and momentum.
  std::vector<MuonGroup> groups() const {
    MuonGroup a, b;
    a.hyperparameters.lr = 0.02;
    b.hyperparameters.lr = 0.05;
    b.hyperparameters.momentum = 0.9;
    for (size_t i = 0; i < params.size(); ++i) {
      MuonGroup& g = i == 1 ? b : a;
      g.params.push_back(params[i].view());
      g.grads.push_back(grads[i].view());
      g.shapes.push_back(kShapes[i]);
    }
    return {a, b};
  }
  void new_gradients(Device device, std::mt19937_64& rng) {
    for (auto& g : grads) {
      const auto bytes = TestTensor(device, DType::f32, random_values(rng, g.numel())).bytes();
      copy_from_host(g.view().data, device, bytes.data(), bytes.size());
    }
  }
  std::vector<std::vector<uint8_t>> bits() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& p : params) out.push_back(p.bytes());
    return out;
  }
};

using MuonOptimizer = OnEachDevice;

// One more step of both, on the same new gradients: the same weights, bit for bit.
void expect_the_same_next_step(Device device, Model& straight, Muon& a, Model& resumed, Muon& b, uint64_t seed) {
  std::mt19937_64 next1(seed), next2(seed);
  straight.new_gradients(device, next1);
  resumed.new_gradients(device, next2);
  a.step();
  b.step();
  EXPECT_EQ(straight.bits(), resumed.bits());
}

// The owning optimizer's steps are its plan's: the same as a MuonPlan over
// the same tensors with momentum buffers of its own.
TEST_P(MuonOptimizer, StepsAsItsPlanAndCounts) {
  Model owned(device(), 1), planned(device(), 1);
  Muon muon(owned.groups());
  std::vector<TestTensor> momentum;
  std::vector<TensorView> pv, gv, mv;
  std::vector<int32_t> group_of;
  for (size_t i = 0; i < planned.params.size(); ++i) {
    momentum.emplace_back(device(), DType::f32, std::vector<double>(static_cast<size_t>(planned.params[i].numel()), 0.0));
    pv.push_back(planned.params[i].view());
    gv.push_back(planned.grads[i].view());
    mv.push_back(momentum.back().view());
    group_of.push_back(i == 1 ? 1 : 0);
  }
  const auto groups = owned.groups();
  const std::vector<MuonHyperparameters> hyper = {groups[0].hyperparameters, groups[1].hyperparameters};
  // The owning optimizer flattens its groups: group 0's tensors (0, 2), then group 1's (1).
  const std::vector<TensorView> pv2 = {pv[0], pv[2], pv[1]}, gv2 = {gv[0], gv[2], gv[1]}, mv2 = {mv[0], mv[2], mv[1]};
  const std::vector<MatrixShape> shapes = {kShapes[0], kShapes[2], kShapes[1]};
  const std::vector<int32_t> groups2 = {0, 0, 1};
  const MuonPlan plan({pv2, gv2, mv2, shapes}, hyper, groups2);
  std::mt19937_64 r1(2), r2(2);
  for (int step = 0; step < 3; ++step) {
    owned.new_gradients(device(), r1);
    planned.new_gradients(device(), r2);
    muon.step();
    plan.step();
  }
  EXPECT_EQ(owned.bits(), planned.bits());
  EXPECT_EQ(muon.step_count(), 3);
  // The momentum buffers (whole 256-byte blocks each), the second moments
  // (max(rows, cols) floats a matrix: 40 + 3 * 24 + 40), the counter.
  EXPECT_EQ(muon.state_bytes(),
            256 * ((sizeof(float) * 960 + 255) / 256) * 2 + 256 * ((4 * 1152 + 255) / 256) + 4 * (40 + 72 + 40) + 8);
}

TEST_P(MuonOptimizer, FoundInfChangesNothing) {
  Model m(device(), 3);
  Muon muon(m.groups());
  const auto before = m.bits();
  const TestFlag found(device(), true);
  muon.step({}, {found.pointer()});
  EXPECT_EQ(m.bits(), before);
  EXPECT_EQ(muon.step_count(), 0);
}

// Saved after two steps and loaded into a fresh optimizer over copies of the
// weights, the third step is the straight run's, bit for bit; so are the
// hyperparameters (a changed lr travels with the file).
TEST_P(MuonOptimizer, SaveLoadResumesBitExactly) {
  Model straight(device(), 4), resumed(device(), 4);
  Muon a(straight.groups());
  std::mt19937_64 r1(5);
  for (int step = 0; step < 2; ++step) {
    straight.new_gradients(device(), r1);
    a.step();
  }
  MuonHyperparameters h = a.hyperparameters(1);
  h.lr = 0.01;
  a.set_hyperparameters(1, h);
  const std::string path = temp_path("muon_resume");
  a.save(path);
  for (size_t i = 0; i < resumed.params.size(); ++i) {
    const auto bytes = straight.params[i].bytes();
    copy_from_host(resumed.params[i].view().data, device(), bytes.data(), bytes.size());
  }
  Muon b(resumed.groups());
  b.load(path);
  EXPECT_EQ(b.step_count(), 2);
  EXPECT_EQ(b.hyperparameters(1).lr, 0.01);
  expect_the_same_next_step(device(), straight, a, resumed, b, 6);
  std::remove(path.c_str());
}

// The recipe's groups (NorMuon's second moment among the state) resume bit
// for bit, and the file's recipe replaces the loading optimizer's.
TEST_P(MuonOptimizer, RecipeSaveLoadResumesBitExactly) {
  const auto with_recipe = [](std::vector<MuonGroup> groups) {
    MuonHyperparameters& h = groups[0].hyperparameters;
    h.set_ns_coefficients(kPolarExpressCoefficients);
    h.divisor = MuonDivisor::polar_express;
    h.equilibrate_rows = h.renormalize = h.second_moment = h.cautious_weight_decay = true;
    h.beta2 = 0.9;
    return groups;
  };
  Model straight(device(), 14), resumed(device(), 14);
  Muon a(with_recipe(straight.groups()));
  std::mt19937_64 r1(15);
  for (int step = 0; step < 2; ++step) {
    straight.new_gradients(device(), r1);
    a.step();
  }
  const std::string path = temp_path("muon_recipe_resume");
  a.save(path);
  Muon b(resumed.groups());  // without the recipe: the file's takes its place
  for (size_t i = 0; i < resumed.params.size(); ++i) {
    const auto bytes = straight.params[i].bytes();
    copy_from_host(resumed.params[i].view().data, device(), bytes.data(), bytes.size());
  }
  b.load(path);
  EXPECT_TRUE(b.hyperparameters(0).second_moment);
  EXPECT_EQ(b.hyperparameters(0).ns_coefficient_count, 5);
  EXPECT_FALSE(b.hyperparameters(1).second_moment);
  const auto raw = [](const TensorView& v) {
    std::vector<uint8_t> out(v.bytes());
    copy_to_host(out.data(), v.data, out.size(), v.device);
    return out;
  };
  for (size_t i = 0; i < a.second_moment().size(); ++i) EXPECT_EQ(raw(a.second_moment()[i]), raw(b.second_moment()[i]));
  EXPECT_NE(raw(a.second_moment()[0]), std::vector<uint8_t>(a.second_moment()[0].bytes(), 0));  // it holds state
  expect_the_same_next_step(device(), straight, a, resumed, b, 16);
  std::remove(path.c_str());
}

// A file written without the recipe's sections (torch's step) loads: the
// recipe's defaults and a zero second moment.
TEST_P(MuonOptimizer, LoadsFilesWithoutTheRecipe) {
  Model m(device(), 17);
  Muon a(m.groups());
  std::mt19937_64 r(18);
  m.new_gradients(device(), r);
  a.step();
  const std::string path = temp_path("muon_no_recipe");
  a.save(path);
  const StateFile full = StateFile::read(path);
  StateFile old;
  for (const std::string& name : full.names()) {
    if (name != "recipe" && name != "second_moment") old.add(name, full.get(name));
  }
  old.write(path);
  auto groups = m.groups();
  groups[0].hyperparameters.equilibrate_rows = true;
  Muon b(groups);
  b.load(path);
  EXPECT_FALSE(b.hyperparameters(0).equilibrate_rows);
  EXPECT_EQ(b.step_count(), 1);
  std::remove(path.c_str());
}

TEST_P(MuonOptimizer, RefusesFilesNotItsOwn) {
  Model m(device(), 7);
  Muon muon(m.groups());
  const auto before = m.bits();
  // An Adam file.
  AdamGroup g;
  g.params = {m.params[0].view()};
  g.grads = {m.grads[0].view()};
  Adam adam({g});
  const std::string adam_path = temp_path("adam_for_muon");
  adam.save(adam_path);
  expect_error([&] { muon.load(adam_path); }, ErrorCode::io_error, {adam_path, "'adam'", "'muon'"});
  // A Muon file whose matrices have other shapes (the same element counts).
  Model other(device(), 7);
  auto groups = other.groups();
  groups[0].shapes[0] = {1, 40, 24};
  Muon transposed(groups);
  const std::string path = temp_path("muon_shapes");
  transposed.save(path);
  expect_error([&] { muon.load(path); }, ErrorCode::io_error, {path, "other shapes"});
  EXPECT_EQ(m.bits(), before);
  EXPECT_EQ(muon.step_count(), 0);
  std::remove(adam_path.c_str());
  std::remove(path.c_str());
}

TEST_P(MuonOptimizer, RefusesBadArguments) {
  Model m(device(), 8);
  auto groups = m.groups();
  groups[0].shapes.pop_back();
  expect_error([&] { Muon muon(groups); }, ErrorCode::size_mismatch, {"groups[0].shapes", "one per param"});
  MuonOptions options;
  options.momentum_dtype = DType::f16;
  expect_error([&] { Muon muon(m.groups(), options); }, ErrorCode::dtype_unsupported,
               {"options.momentum_dtype", "f32 or bf16"});
  Muon muon(m.groups());
  MuonHyperparameters bad;
  bad.ns_steps = 0;
  expect_error([&] { muon.set_hyperparameters(0, bad); }, ErrorCode::invalid_argument, {"ns_steps"});
  EXPECT_EQ(muon.hyperparameters(0).ns_steps, 5);
  expect_error([&] { muon.set_hyperparameters(2, bad); }, ErrorCode::invalid_argument, {"group", "[0, 2)"});
}

INSTANTIATE_TEST_SUITE_P(Devices, MuonOptimizer, ::testing::Values(Device::cpu(), Device::cuda(0)), device_test_name);

}  // namespace
}  // namespace gradkit::test
