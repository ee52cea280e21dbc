// The ops that take their caller's name (validate for each optimizer's
// hyperparameters, validate_eta, an optimizer plan's GroupTable) put that
// name, not their own, in every error they raise: the owning optimizers'
// errors name the optimizer (OffloadedAdam's say OffloadedAdam, not adam_step).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/lamb.h"
#include "gradkit/ops/muon.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/offloaded.h"
#include "support/offload_model.h"
#include "support/test_tensor.h"

namespace gradkit::test {
namespace {

constexpr std::string_view kCaller = "my_caller";

// `call` throws invalid_argument (or `code`) whose message begins with
// "<caller>: argument '<arg>'" and names no other op.
void expect_named(const std::function<void()>& call, std::string_view caller, const std::string& arg,
                  ErrorCode code = ErrorCode::invalid_argument) {
  try {
    call();
    ADD_FAILURE() << "expected an Error naming " << caller << " and '" << arg << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), code) << what;
    EXPECT_EQ(what.rfind(std::string(caller) + ": argument '" + arg + "'", 0), 0u) << what;
    for (const char* other : {"adam_step", "lamb_step", "muon_step"}) {
      EXPECT_EQ(what.find(other), std::string::npos) << what;
    }
  }
}

template <class Hyper>
using Breaks = std::vector<std::pair<std::string, std::function<void(Hyper&)>>>;

const Breaks<AdamHyperparameters> kAdamBreaks = {
    {"lr", [](auto& h) { h.lr = -1; }},
    {"beta1", [](auto& h) { h.beta1 = 1; }},
    {"beta2", [](auto& h) { h.beta2 = -0.5f; }},
    {"eps", [](auto& h) { h.eps = 0; }},
    {"weight_decay", [](auto& h) { h.weight_decay = std::nanf(""); }},
    {"decay", [](auto& h) { h.decay = static_cast<WeightDecay>(7); }},
};

const Breaks<LambHyperparameters> kLambBreaks = {
    {"alpha", [](auto& h) { h.alpha = 1; }},
    {"beta", [](auto& h) { h.beta = -0.1f; }},
    {"lambda", [](auto& h) { h.lambda = -1; }},
    {"epsilon", [](auto& h) { h.epsilon = 0; }},
    {"ratio_min", [](auto& h) { h.ratio_min = std::nanf(""); }},
    {"ratio_max", [](auto& h) { h.ratio_min = 2, h.ratio_max = 1; }},
    {"max_norm", [](auto& h) { h.max_norm = std::numeric_limits<float>::infinity(); }},
};

const Breaks<MuonHyperparameters> kMuonBreaks = {
    {"lr", [](auto& h) { h.lr = -1; }},
    {"weight_decay", [](auto& h) { h.weight_decay = -1; }},
    {"momentum", [](auto& h) { h.momentum = 1; }},
    {"eps", [](auto& h) { h.eps = 0; }},
    {"ns_coefficients[0].a", [](auto& h) { h.ns_coefficients[0].a = std::nanf(""); }},
    {"ns_coefficients[0].b", [](auto& h) { h.ns_coefficients[0].b = std::numeric_limits<float>::infinity(); }},
    {"ns_coefficients[0].c", [](auto& h) { h.ns_coefficients[0].c = std::nanf(""); }},
    {"ns_steps", [](auto& h) { h.ns_steps = 0; }},
    {"adjust_lr", [](auto& h) { h.adjust_lr = static_cast<MuonLrAdjust>(5); }},
    {"ns_coefficient_count", [](auto& h) { h.ns_coefficient_count = 0; }},
    {"divisor", [](auto& h) { h.divisor = static_cast<MuonDivisor>(3); }},
    {"beta2", [](auto& h) { h.beta2 = 1; }},
};

// validate(h, caller, arg) and a GroupTable's set and set_on name the caller
// for every field they check, and the table's group count too.
template <class Hyper>
void expect_every_field_names_the_caller(const Breaks<Hyper>& breaks) {
  for (const auto& [field, spoil] : breaks) {
    SCOPED_TRACE(field);
    Hyper h;
    spoil(h);
    expect_named([&] { validate(h, kCaller, "h"); }, kCaller, "h." + field);
    const std::vector<Hyper> entries = {Hyper{}, h};
    detail::GroupTable<Hyper> table;
    expect_named([&] { table.set(kCaller, entries, Device::cpu()); }, kCaller, "hyperparameters[1]." + field);
    expect_named([&] { table.set_on(kCaller, entries, Device::cpu(), {}); }, kCaller,
                 "hyperparameters[1]." + field);
  }
  detail::GroupTable<Hyper> table;
  const std::vector<Hyper> one = {Hyper{}}, two = {Hyper{}, Hyper{}};
  table.set(kCaller, one, Device::cpu());
  expect_named([&] { table.set(kCaller, two, Device::cpu()); }, kCaller, "hyperparameters", ErrorCode::size_mismatch);
}

TEST(CallerNames, AdamHyperparameterChecksNameTheCaller) { expect_every_field_names_the_caller(kAdamBreaks); }

TEST(CallerNames, LambHyperparameterChecksNameTheCaller) { expect_every_field_names_the_caller(kLambBreaks); }

TEST(CallerNames, MuonHyperparameterChecksNameTheCaller) { expect_every_field_names_the_caller(kMuonBreaks); }

TEST(CallerNames, TheEtaCheckNamesTheCaller) {
  expect_named([] { validate_eta(-1.0f, kCaller, "eta"); }, kCaller, "eta");
  expect_named([] { validate_eta(std::nanf(""), kCaller, "options.eta"); }, kCaller, "options.eta");
}

// The owning optimizers pass their own names.
TEST(CallerNames, OffloadedOptimizersNameThemselves) {
  FakeModel m;
  for (const auto& [field, spoil] : kAdamBreaks) {
    SCOPED_TRACE(field);
    AdamGroup g = m.group();
    spoil(g.hyperparameters);
    expect_named([&] { OffloadedAdam({g}); }, "OffloadedAdam", "groups[0].hyperparameters." + field);
  }
  for (const auto& [field, spoil] : kLambBreaks) {
    SCOPED_TRACE(field);
    LambGroup g = m.group<LambGroup>();
    spoil(g.hyperparameters);
    expect_named([&] { OffloadedLamb({g}); }, "OffloadedLamb", "groups[0].hyperparameters." + field);
  }
  OffloadedOptions o;
  o.lamb.eta = -1;
  expect_named([&] { OffloadedLamb({m.group<LambGroup>()}, o); }, "OffloadedLamb", "options.lamb.eta");
  EXPECT_TRUE(m.untouched());
}

TEST(CallerNames, AdamsLearningRateCheckNamesAdam) {
  TestTensor w(Device::cpu(), DType::f32, {1, 2, 3}), g(Device::cpu(), DType::f32, {0.5, 0.25, 0.125});
  AdamGroup group;
  group.params = {w.view()};
  group.grads = {g.view()};
  Adam adam({group});
  expect_named([&] { adam.set_lr(0, -1.0f); }, "Adam", "groups[0].lr");
  EXPECT_EQ(adam.lr(0), group.hyperparameters.lr) << "a refused lr is not kept";
}

}  // namespace
}  // namespace gradkit::test
