// What the tests of Offloaded<Adam> and Offloaded<Lamb> share: a small
// model on the GPU in two parameter groups, its gradients step by step (with
// Inf and NaN when the step is checked), the offloaded optimizer's options,
// and gradkit's step on the GPU that the offloaded one must equal bit for
// bit (the optimizer over f32 masters, with the gradient check and the loss
// scaler composed as MixedPrecision composes them).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/offloaded.h"
#include "optim/offloaded_parts.h"  // OffloadTraits
#include "support/expect_error.h"
#include "support/test_tensor.h"

namespace gradkit::test {

// Host memory that the views below call device memory: the argument checks
// must refuse the call before anything looks at it, and leave it as it was.
struct FakeModel {
  std::vector<float> memory = std::vector<float>(64, 1.5f);
  TensorView at(int offset, int64_t numel, DType dtype = DType::f32, Device device = Device::cuda(0)) {
    return TensorView{memory.data() + offset, numel, dtype, device};
  }
  template <class Group = AdamGroup>
  Group group() {
    Group g;
    g.params = {at(0, 8), at(8, 8)};
    g.grads = {at(16, 8), at(24, 8)};
    return g;
  }
  bool untouched() const {
    for (float v : memory) if (v != 1.5f) return false;
    return true;
  }
};

// Making Offloaded<Optimizer> over `groups` throws `code` with every one of `parts`.
template <class Optimizer>
void expect_refused(std::vector<typename Optimizer::Group> groups, OffloadedOptions options, ErrorCode code,
                    const std::vector<std::string>& parts) {
  expect_error([&] { Offloaded<Optimizer>(std::move(groups), std::move(options)); }, code, parts);
}

// Writes `values`, rounded to the tensor's dtype, into a tensor on any device.
inline void fill(const TensorView& t, const std::vector<double>& values) {
  const TestTensor host(Device::cpu(), t.dtype, values);
  copy_from_host(t.data, t.device, host.view().data, t.bytes());
}

inline std::vector<uint8_t> bits(const std::vector<TensorView>& tensors) {
  std::vector<uint8_t> out;
  for (const TensorView& t : tensors) {
    std::vector<uint8_t> b(t.bytes());
    copy_to_host(b.data(), t.data, b.size(), t.device);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

inline std::string offload_temp_path(const char* name) {
  return ::testing::TempDir() + "gradkit_offload_" + name + "_" + std::to_string(::getpid());
}

struct OffloadConfig {
  DType weight, grad;
  bool check;  // a dynamic loss scaler and clipping
  // Small pieces cut the tensors (Adam: at multiples of 256 elements; LAMB
  // keeps each whole) so that a bucket's copies and steps go piece by
  // piece; the default holds each bucket whole.
  size_t piece_bytes = OffloadedOptions{}.piece_bytes;
  DType moments = DType::f32;  // u8: 8-bit moments, whose blocks the cuts must keep whole
  int32_t moment_bits = 8;     // with u8 moments: 4 for 4-bit ones
};

inline std::string config_name(const OffloadConfig& c) {
  return std::string(dtype_name(c.weight)) + "_" + std::string(dtype_name(c.grad)) + (c.check ? "_checked" : "") +
         (c.piece_bytes != OffloadedOptions{}.piece_bytes ? "_pieces" : "") + (c.moments == DType::u8 ? (c.moment_bits == 4 ? "_4bit" : "_8bit") : "");
}

// The GPU tests over the configurations: skipped where no CUDA device is visible.
class OffloadGpuTest : public ::testing::TestWithParam<OffloadConfig> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  }
};

// How gtest names a config in its output (not its padding bytes).
inline void PrintTo(const OffloadConfig& c, std::ostream* os) { *os << config_name(c); }

// The dtype configurations both optimizers' GPU tests run: weights,
// gradients, a check or none; small pieces (1000-element pieces of f32
// gradients: Adam cuts the 131073-element tensor into 172, LAMB keeps each
// tensor a piece of its own); 8-bit moments.
inline const OffloadConfig kOffloadConfigs[] = {
    {DType::f32, DType::f32, false},
    {DType::f32, DType::bf16, true},
    {DType::bf16, DType::bf16, false},
    {DType::bf16, DType::f32, true},
    {DType::f16, DType::f16, true},
    {DType::f32, DType::f32, false, 4000},
    {DType::bf16, DType::f32, true, 4000, DType::u8},
    {DType::f32, DType::bf16, false, 3000, DType::u8},
};

// 4-bit moments, the tensors cut into pieces (Adam: at multiples of 256
// elements: whole 128-element blocks, whole bytes of codes; LAMB keeps each
// tensor whole).
inline const OffloadConfig kOffload4BitConfigs[] = {
    {DType::bf16, DType::f32, true, 4000, DType::u8, 4},
    {DType::f32, DType::bf16, false, 3000, DType::u8, 4},
    {DType::f32, DType::f32, false, OffloadedOptions{}.piece_bytes, DType::u8, 4},
};

inline const int64_t kOffloadSizes[] = {1000, 65536 * 2 + 1, 3, 4097, 7};

inline OffloadedOptions offload_options(const OffloadConfig& c) {
  OffloadedOptions o;
  o.buckets = {2, 1, 1, 0, 0};  // backward's order: the last tensors first
  o.piece_bytes = c.piece_bytes;
  o.adam.moment_dtype = o.lamb.moment_dtype = c.moments;
  o.adam.moment_bits = o.lamb.moment_bits = c.moment_bits;
  if (c.check) {
    LossScalerOptions s;
    s.initial_scale = 1024.0f;
    s.growth_interval = 5;  // the scale grows, and backs off at each Inf/NaN, within 50 steps
    o.scaler = s;
    o.max_norm = 1.0f;
  }
  return o;
}

// Each group's hyperparameters: the second differs from the defaults.
inline void set_hyperparameters(AdamGroup& g, int index) {
  if (index == 0) {
    g.hyperparameters.weight_decay = 0.01f;
  } else {
    g.hyperparameters.lr = 3e-3f;
    g.hyperparameters.decay = WeightDecay::l2;
    g.hyperparameters.weight_decay = 0.001f;
  }
}
inline void set_hyperparameters(LambGroup& g, int index) {
  if (index == 0) {
    g.hyperparameters.lambda = 0.01f;
  } else {
    g.hyperparameters.alpha = 0.8f;
    g.hyperparameters.lambda = 0.001f;
    g.hyperparameters.ratio_max = 5.0f;
  }
}

// One model's weights and gradients on the GPU, two parameter groups.
struct OffloadModel {
  OffloadConfig config;
  std::vector<TestTensor> w, g;
  OffloadModel(const OffloadConfig& c, uint64_t seed) : config(c) {
    std::mt19937_64 rng(seed);
    for (int64_t n : kOffloadSizes) {
      w.emplace_back(Device::cuda(0), c.weight, random_values(rng, n));
      g.emplace_back(Device::cuda(0), c.grad, random_values(rng, n));
    }
  }
  std::vector<TensorView> weights() const {
    std::vector<TensorView> out;
    for (const auto& t : w) out.push_back(t.view());
    return out;
  }
  std::vector<TensorView> grads() const {
    std::vector<TensorView> out;
    for (const auto& t : g) out.push_back(t.view());
    return out;
  }
  // The groups over `params` (the model's weights, or masters).
  template <class Group>
  std::vector<Group> groups(const std::vector<TensorView>& params) const {
    std::vector<Group> out(2);
    set_hyperparameters(out[0], 0);
    set_hyperparameters(out[1], 1);
    for (size_t i = 0; i < w.size(); ++i) {
      Group& into = out[i < 2 ? 0 : 1];
      into.params.push_back(params[i]);
      into.grads.push_back(g[i].view());
    }
    return out;
  }
  // Step s's gradients: seeded random values times 8; with a check, an Inf
  // at steps 5 and 33 and a NaN at step 17 in one tensor (without one they
  // would make NaN weights, whose payloads the backends need not share).
  // `factor`: the values times it (2: what two hands of the same gradients add up to, exactly).
  void write_gradients(int s, double factor = 1.0) {
    std::mt19937_64 rng(1000 + static_cast<uint64_t>(s));
    for (size_t i = 0; i < g.size(); ++i) {
      std::vector<double> v = random_values(rng, g[i].numel(), 8.0 * factor);
      if (config.check && i == 1 && (s == 5 || s == 33)) v[77] = INFINITY;
      if (config.check && i == 3 && s == 17) v[4096] = NAN;
      fill(g[i].view(), v);
    }
  }
};

// The optimizer's update with the check's decision and gradient divisor.
inline void checked_step(Adam& adam, const bool* found_inf, const float* divisor) { adam.step({}, found_inf, divisor); }
inline void checked_step(Lamb& lamb, const bool* found_inf, const float* divisor) {
  LambStep in;  // as MixedPrecision<Lamb>: the global clipping is in the divisor
  in.loss_scale_device = divisor;
  in.found_inf = found_inf;
  lamb.step({}, in);
}

// gradkit's step on the GPU: f32 masters (the weights themselves for f32)
// and the model's weights as their copy, the gradient check and the loss
// scaler as MixedPrecision composes them.
template <class Optimizer>
struct GpuStep {
  using Group = typename Optimizer::Group;
  OffloadModel& model;
  std::vector<TestTensor> master_storage;
  std::vector<TensorView> masters;
  std::optional<Optimizer> optimizer;
  std::optional<GradientCheckPlan> check;
  std::optional<LossScaler> scaler;
  Buffer scalars{Device::cuda(0), 16};  // found_inf, then the divisor at 4, the norm at 8

  explicit GpuStep(OffloadModel& m) : model(m) {
    const bool low = m.config.weight != DType::f32;
    if (low) {
      for (const auto& t : m.w) master_storage.emplace_back(Device::cuda(0), DType::f32, t.read());
      for (const auto& t : master_storage) masters.push_back(t.view());
    } else {
      masters = m.weights();
    }
    std::vector<Group> groups = m.groups<Group>(masters);
    if (low) {
      size_t at = 0;
      for (Group& g : groups) for (size_t i = 0; i < g.params.size(); ++i) g.model_copy.push_back(m.w[at++].view());
    }
    const OffloadedOptions o = offload_options(m.config);
    optimizer.emplace(groups, OffloadTraits<Optimizer>::options(o));
    if (m.config.check) {
      check.emplace(m.grads(), GradientCheckOptions{NormType::l2, o.max_norm, false});
      scaler.emplace(Device::cuda(0), *o.scaler);
    }
  }
  bool* found_inf() const { return static_cast<bool*>(scalars.data()); }
  float* divisor() const { return reinterpret_cast<float*>(static_cast<char*>(scalars.data()) + 4); }
  bool skipped() const {
    bool out = false;
    copy_to_host(&out, found_inf(), 1, Device::cuda(0));
    return out;
  }
  void step() {
    if (!check) return optimizer->step();
    check->check({found_inf(), divisor(), divisor() + 1, nullptr}, 1.0f, scaler->scale_device());
    checked_step(*optimizer, found_inf(), divisor());
    scaler->update(found_inf());
  }
};

// What the offloaded step computes, composed from the public API: the
// optimizer on the host over host masters (and copies, for f16/bf16
// weights), its gradients copied from the model's each step; the check and
// the scaler on the GPU, their decision and divisor copied to the host; the
// weights copied back. LAMB's CPU and CUDA norms differ in rounding (f64
// against f32 per-chunk sums, docs/ops.md), so this, not GpuStep, is what
// OffloadedLamb with float moments must equal bit for bit.
template <class Optimizer>
struct HostStep {
  using Group = typename Optimizer::Group;
  OffloadModel& model;
  std::vector<TestTensor> masters, grads, copies;  // host
  std::optional<Optimizer> optimizer;
  std::optional<GradientCheckPlan> check;
  std::optional<LossScaler> scaler;
  Buffer scalars{Device::cuda(0), 16};  // as GpuStep's
  bool found_inf = false;
  float divisor = 1.0f;

  explicit HostStep(OffloadModel& m) : model(m) {
    const bool low = m.config.weight != DType::f32;
    std::vector<TensorView> host_masters;
    for (size_t i = 0; i < m.w.size(); ++i) {
      masters.emplace_back(Device::cpu(), DType::f32, m.w[i].read());
      grads.emplace_back(Device::cpu(), m.config.grad, m.g[i].read());
      if (low) copies.emplace_back(Device::cpu(), m.config.weight, m.w[i].read());
      host_masters.push_back(masters.back().view());
    }
    std::vector<Group> groups = m.groups<Group>(host_masters);
    size_t at = 0;
    for (Group& g : groups) {
      for (size_t i = 0; i < g.params.size(); ++i, ++at) {
        g.grads[i] = grads[at].view();
        if (low) g.model_copy.push_back(copies[at].view());
      }
    }
    const OffloadedOptions o = offload_options(m.config);
    optimizer.emplace(groups, OffloadTraits<Optimizer>::options(o));
    if (m.config.check) {
      check.emplace(m.grads(), GradientCheckOptions{NormType::l2, o.max_norm, false});
      scaler.emplace(Device::cuda(0), *o.scaler);
    }
  }
  void step() {
    for (size_t i = 0; i < grads.size(); ++i) {
      copy_to_host(grads[i].view().data, model.g[i].view().data, model.g[i].view().bytes(), Device::cuda(0));
    }
    if (check) {
      auto* found = static_cast<bool*>(scalars.data());
      auto* div = reinterpret_cast<float*>(static_cast<char*>(scalars.data()) + 4);
      check->check({found, div, div + 1, nullptr}, 1.0f, scaler->scale_device());
      scaler->update(found);
      copy_to_host(&found_inf, found, 1, Device::cuda(0));
      copy_to_host(&divisor, div, sizeof divisor, Device::cuda(0));
      checked_step(*optimizer, &found_inf, &divisor);  // host pointers: the optimizer is on the host
    } else {
      optimizer->step();
    }
    const std::vector<TestTensor>& from = copies.empty() ? masters : copies;
    for (size_t i = 0; i < from.size(); ++i) {
      copy_from_host(model.w[i].view().data, Device::cuda(0), from[i].view().data, from[i].view().bytes());
    }
  }
  std::vector<TensorView> master_views() const {
    std::vector<TensorView> out;
    for (const auto& t : masters) out.push_back(t.view());
    return out;
  }
};

template <class Optimizer>
void offloaded_step(Offloaded<Optimizer>& off) {
  for (int b = 0; b < off.num_buckets(); ++b) off.bucket_ready(b);  // as backward completes them
  off.finish();
}

// The options of offload_options(c) with gradient release.
inline OffloadedOptions release_options(const OffloadConfig& c) {
  OffloadedOptions o = offload_options(c);
  o.release = true;
  return o;
}

// One step with release that hands each bucket twice, as two micro-batches
// do: the second hand completes the buckets whose index has the parity
// `complete_parity`, finish() the others.
template <class Optimizer>
void step_handing_twice(Offloaded<Optimizer>& off, int complete_parity) {
  for (int b = 0; b < off.num_buckets(); ++b) off.bucket_ready(b, {}, {}, false);
  for (int b = 0; b < off.num_buckets(); ++b) off.bucket_ready(b, {}, {}, b % 2 == complete_parity);
  off.finish();
}

// Steps first..last of `a` offloaded and of `b` by `other_step`, on the same gradients.
template <class Optimizer, class Step>
void step_both(OffloadModel& a, Offloaded<Optimizer>& off, OffloadModel& b, Step&& other_step, int first, int last) {
  for (int s = first; s <= last; ++s) {
    a.write_gradients(s);
    b.write_gradients(s);
    offloaded_step(off);
    other_step();
  }
}

// 20 steps straight equal 10 steps, a save, a new optimizer loading it, and
// 10 more: the weights, the step count and the moments. The model's weights
// are the caller's to restore (they are the model's checkpoint); for
// f16/bf16 ones load() rewrites them from the masters.
template <class Optimizer>
void expect_a_resumed_run_equals_the_straight_run(const OffloadConfig& c) {
  using Group = typename Optimizer::Group;
  OffloadModel straight(c, 11), resumed(c, 11);
  Offloaded<Optimizer> a(straight.groups<Group>(straight.weights()), offload_options(c));
  const std::string path = offload_temp_path("resume");
  {
    Offloaded<Optimizer> first(resumed.groups<Group>(resumed.weights()), offload_options(c));
    for (int s = 1; s <= 10; ++s) {
      resumed.write_gradients(s);
      offloaded_step(first);
    }
    first.save(path);
  }
  for (int s = 1; s <= 10; ++s) {
    straight.write_gradients(s);
    offloaded_step(a);
  }
  Offloaded<Optimizer> second(resumed.groups<Group>(resumed.weights()), offload_options(c));
  second.load(path);
  EXPECT_EQ(second.step_count(), a.step_count());
  for (int s = 11; s <= 20; ++s) {
    straight.write_gradients(s);
    resumed.write_gradients(s);
    offloaded_step(a);
    offloaded_step(second);
  }
  EXPECT_EQ(bits(straight.weights()), bits(resumed.weights()));
  EXPECT_EQ(a.step_count(), second.step_count());
  EXPECT_EQ(bits(a.host_optimizer().exp_avg_sq()), bits(second.host_optimizer().exp_avg_sq()));
  std::remove(path.c_str());
}

// f16/bf16 weights with a scaler (`c`): the offloaded optimizer's file is
// MixedPrecision's, and the two optimizers go on from each other's files
// bit for bit (`c` with moments whose steps the two backends share).
template <class Optimizer>
void expect_the_mixed_precision_file_moves_both_ways(const OffloadConfig& c, const std::string& path) {
  using Group = typename Optimizer::Group;
  OffloadModel a(c, 4), b(c, 4);
  const OffloadedOptions o = offload_options(c);
  Offloaded<Optimizer> off(a.groups<Group>(a.weights()), o);
  MixedPrecisionOptions mo;
  mo.scaler = *o.scaler;
  mo.max_norm = o.max_norm;
  MixedPrecision<Optimizer> mixed(b.groups<Group>(b.weights()), mo, OffloadTraits<Optimizer>::options(o));
  for (int s = 1; s <= 6; ++s) {
    a.write_gradients(s);
    offloaded_step(off);
  }
  off.save(path);
  mixed.load(path);  // writes b's weights from the masters
  EXPECT_EQ(bits(a.weights()), bits(b.weights()));
  step_both(a, off, b, [&] { mixed.step(); }, 7, 12);
  EXPECT_EQ(bits(a.weights()), bits(b.weights()));
  EXPECT_EQ(off.scaler()->state().scale, mixed.loss_scale());
  mixed.save(path);
  OffloadModel fresh(c, 99);
  Offloaded<Optimizer> back(fresh.groups<Group>(fresh.weights()), o);
  back.load(path);
  EXPECT_EQ(bits(fresh.weights()), bits(b.weights()));
  EXPECT_EQ(bits(back.masters()), bits(mixed.masters()));
}

}  // namespace gradkit::test
