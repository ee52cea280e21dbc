// What the sharded optimizer's tests share (test_sharded.cc, the optimizers
// and the layout; test_sharded_forms.cc, the compact state forms): the test
// model and its gradients, the unsharded step to compare with (Unsharded),
// the two side by side (Pair), and the test cases' setup.
// Gradients are multiples of a power of two small enough that their sum over
// ranks is exact in every dtype, so that a reduce-scatter and an all-reduce
// give the same bits whatever their order of additions.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/comm_test_support.h"
#include "gradkit/comm/gradient_arena.h"
#include "gradkit/core/error.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/grad_check.h"
#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/sharded.h"
#include "gradkit/optim/state_file.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {

inline const std::vector<int64_t> kModel = {1000, 37, 3, 4096, 129, 1, 700};
inline const std::vector<int64_t> kTiny = {3, 5};  // with 4 ranks, two own only padding

// What the tests need to know of each optimizer: two groups' hyperparameters
// (the first three tensors, the rest), its step with the check's divisor
// and flag, and its learning rate.
template <class Optimizer> struct Kind;

template <>
struct Kind<Adam> {
  static std::vector<AdamHyperparameters> hyperparameters(bool amsgrad) {
    AdamHyperparameters a;
    a.lr = 1e-2f;
    a.weight_decay = 0.01f;
    a.amsgrad = amsgrad;
    AdamHyperparameters b;
    b.lr = 3e-3f;
    b.beta1 = 0.8f;
    b.weight_decay = 1e-3f;
    b.decay = WeightDecay::l2;
    return {a, b};
  }
  static void step(Adam& adam, const bool* found_inf, const float* divisor) { adam.step({}, found_inf, divisor); }
  static void set_rate(Adam& adam, float rate) { adam.set_lr(0, rate); }
  static void set_rate(ShardedAdam& sharded, float rate) { sharded.set_lr(0, rate); }
};

template <>
struct Kind<Lamb> {
  static std::vector<LambHyperparameters> hyperparameters(bool) {
    LambHyperparameters a;
    a.lambda = 0.01f;
    LambHyperparameters b;
    b.alpha = 0.8f;
    b.ratio_min = 0.05f;
    b.ratio_max = 5.0f;
    return {a, b};
  }
  static void step(Lamb& lamb, const bool* found_inf, const float* divisor) {
    LambStep in;
    in.loss_scale_device = divisor;
    in.found_inf = found_inf;
    lamb.step({}, in);
  }
  static void set_rate(Lamb& lamb, float rate) { lamb.set_eta(rate); }
  static void set_rate(ShardedLamb& sharded, float rate) { sharded.set_eta(rate); }
};

template <class Hyper>
auto groups_of(std::span<const TensorView> params, std::span<const TensorView> grads, const std::vector<Hyper>& hyper) {
  using Group = std::conditional_t<std::is_same_v<Hyper, AdamHyperparameters>, AdamGroup, LambGroup>;
  const size_t split = std::min<size_t>(3, params.size() - 1);
  std::vector<Group> groups(2);
  for (size_t i = 0; i < params.size(); ++i) {
    Group& g = groups[i < split ? 0 : 1];
    g.params.push_back(params[i]);
    g.grads.push_back(grads[i]);
  }
  groups[0].hyperparameters = hyper[0];
  groups[1].hyperparameters = hyper[1];
  return groups;
}

// A tensor's values, exactly, as float64.
inline std::vector<double> values(const TensorView& t) {
  TestTensor host(Device::cpu(), t.dtype, std::vector<double>(static_cast<size_t>(t.numel), 0.0));
  copy_to_host(host.view().data, t.data, t.bytes(), t.device);
  return host.read();
}

inline void put(const TensorView& t, const std::vector<double>& values) {
  const TestTensor host(Device::cpu(), t.dtype, values);
  copy_from_host(t.data, t.device, host.view().data, t.bytes());
}

inline std::vector<uint8_t> bits(const TensorView& t) {
  std::vector<uint8_t> b(t.bytes());
  copy_to_host(b.data(), t.data, t.bytes(), t.device);
  return b;
}

inline std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A path every rank of `comm` agrees on (rank 0's process id in it).
inline std::string shared_path(MPI_Comm comm, const std::string& name) {
  int pid = static_cast<int>(getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, comm);
  return "/tmp/gradkit_sharded_" + name + "_" + std::to_string(pid) + ".state";
}

// Rank `rank`'s gradient of tensor `t` at step `step`: multiples of 2^-q in
// [-4, 4] (q by dtype), so that sums over up to 4 ranks are exact.
inline std::vector<double> gradient(uint64_t seed, int step, int rank, size_t t, int64_t n, DType dtype) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(step) * 7919 + static_cast<uint64_t>(rank) * 131 + t);
  const double q = dtype == DType::f32 ? 0x1p10 : dtype == DType::f16 ? 0x1p6 : 0x1p2;
  std::vector<double> v = random_values(rng, n, 1.5);
  for (double& x : v) {
    x = std::clamp(std::round(x * q) / q, -4.0, 4.0);
    if (x == 0) x = 1 / q;
  }
  return v;
}

struct RunSetup {
  DType weights = DType::f32;
  DType grads = DType::f32;
  std::vector<int64_t> model = kModel;
  int64_t bucket_elements = 1500;
  int64_t alignment = 64;  // the layout's (a multiple of kQuantBlock for 8-bit moments)
  ShardedOptions options;
  bool amsgrad = false;
  uint64_t seed = 1;
};

// The unsharded step on the same model: the gradients all-reduced (average),
// then the check (Inf/NaN skip, clipping) and the update, as MixedPrecision
// does for f16/bf16 weights and GradientCheckPlan + the optimizer for f32.
template <class Optimizer>
class Unsharded {
 public:
  Unsharded(Communicator& comm, const RunSetup& s, const std::vector<std::vector<double>>& initial) : comm_(comm) {
    for (size_t i = 0; i < s.model.size(); ++i) {
      weights_.emplace_back(comm.device(), s.weights, initial[i]);
      grads_.emplace_back(comm.device(), s.grads, std::vector<double>(static_cast<size_t>(s.model[i]), 0.0));
      w_.push_back(weights_.back().view());
      g_.push_back(grads_.back().view());
    }
    auto groups = groups_of(w_, g_, Kind<Optimizer>::hyperparameters(s.amsgrad));
    if (s.weights == DType::f32) {
      GradientCheckOptions o;
      o.max_norm = s.options.max_norm;
      o.norm = s.options.norm;
      check_ = GradientCheckPlan(g_, o);
      scalars_ = Buffer(comm.device(), 16);
      plain_ = std::make_unique<Optimizer>(std::move(groups), options(s.options));
    } else {
      MixedPrecisionOptions o;
      o.scaler = s.options.scaler;
      o.max_norm = s.options.max_norm;
      o.norm = s.options.norm;
      o.master = s.options.master;
      mixed_ = std::make_unique<MixedPrecision<Optimizer>>(std::move(groups), o, options(s.options));
    }
  }

  const std::vector<TensorView>& weights() const { return w_; }
  const std::vector<TensorView>& grads() const { return g_; }

  void step() {
    comm_.all_reduce(g_, ReduceOp::average);
    if (mixed_) {
      mixed_->step();
    } else {
      auto* divisor = static_cast<float*>(scalars_.data());
      auto* found_inf = reinterpret_cast<bool*>(divisor + 2);
      check_.check({.found_inf = found_inf, .grad_divisor = divisor, .global_norm = divisor + 1});
      Kind<Optimizer>::step(*plain_, found_inf, divisor);
    }
    comm_.wait();
  }
  bool skipped() const {
    if (mixed_) return mixed_->last_step_skipped();
    bool b = false;
    copy_to_host(&b, static_cast<float*>(scalars_.data()) + 2, 1, scalars_.device());
    return b;
  }
  float norm() const {
    if (mixed_) return mixed_->last_grad_norm();
    float n = 0;
    copy_to_host(&n, static_cast<float*>(scalars_.data()) + 1, sizeof n, scalars_.device());
    return n;
  }
  float loss_scale() const { return mixed_ ? mixed_->loss_scale() : 1.0f; }
  void set_rate(float rate) { Kind<Optimizer>::set_rate(mixed_ ? mixed_->optimizer() : *plain_, rate); }
  void save(const std::string& path) const { mixed_ ? mixed_->save(path) : plain_->save(path); }
  void load(const std::string& path) { mixed_ ? mixed_->load(path) : plain_->load(path); }

 private:
  static const typename Optimizer::Options& options(const ShardedOptions& o) {
    if constexpr (std::is_same_v<Optimizer, Adam>) return o.adam;
    else return o.lamb;
  }

  Communicator& comm_;
  std::vector<TestTensor> weights_, grads_;
  std::vector<TensorView> w_, g_;
  GradientCheckPlan check_;
  Buffer scalars_;
  std::unique_ptr<Optimizer> plain_;
  std::unique_ptr<MixedPrecision<Optimizer>> mixed_;
};

// The sharded optimizer and the unsharded one side by side on one communicator.
template <class Optimizer = Adam>
class Pair {
 public:
  Pair(Communicator& comm, const RunSetup& s)
      : comm_(comm),
        s_(s),
        layout_(ShardedLayout::make(s.model, comm.size(), s.bucket_elements, s.alignment)),
        weights_(comm.device(), s.weights, layout_),
        grads_(comm.device(), s.grads, layout_) {
    std::mt19937_64 rng(s.seed);
    for (size_t i = 0; i < s.model.size(); ++i) {
      initial_.push_back(round_to(s.weights, random_values(rng, s.model[i], 0.5)));
      put(weights_[i], initial_[i]);
    }
    reference_ = std::make_unique<Unsharded<Optimizer>>(comm, s, initial_);
    sharded_ = std::make_unique<Sharded<Optimizer>>(
        comm, layout_, groups_of(weights_.gradients(), grads_.gradients(), Kind<Optimizer>::hyperparameters(s.amsgrad)),
        s.options);
  }

  Sharded<Optimizer>& sharded() { return *sharded_; }
  Unsharded<Optimizer>& reference() { return *reference_; }
  const GradientArena& weights() const { return weights_; }
  const ShardedLayout& layout() const { return layout_; }

  // Writes this rank's gradients of `step` into both (an Inf or a NaN in
  // one element of the last rank's on the steps that `poison` names).
  void write_gradients(int step, bool poison = false) {
    for (size_t i = 0; i < s_.model.size(); ++i) {
      std::vector<double> g = gradient(s_.seed, step, comm_.rank(), i, s_.model[i], s_.grads);
      if (poison && comm_.rank() == comm_.size() - 1 && i == 3 % s_.model.size()) {
        g[g.size() / 2] = step % 2 ? NAN : INFINITY;
      }
      put(grads_[i], g);
      put(reference_->grads()[i], g);
    }
  }

  // One step of both; stage 2 (buckets marked as backward finishes them, in
  // reverse order) when `stage2`.
  void step(bool stage2) {
    if (stage2) {
      for (size_t i = s_.model.size(); i-- > 0;) sharded_->mark_ready(i);
    }
    sharded_->step();
    comm_.wait();
    reference_->step();
  }

  // The weights of both, bitwise (or, given `tolerance`, within it: the
  // relative error of each tensor); the decisions.
  int expect_same(const std::string& what, double tolerance = 0) {
    int failures = 0;
    for (size_t i = 0; i < s_.model.size(); ++i) {
      const bool same = tolerance == 0 ? bits(weights_[i]) == bits(reference_->weights()[i])
                                       : relative_error(values(weights_[i]), values(reference_->weights()[i])) <= tolerance;
      if (!same) {
        ADD_FAILURE() << what << ": tensor " << i << " differs from the unsharded step";
        if (++failures > 3) break;
      }
    }
    EXPECT_EQ(sharded_->last_step_skipped(), reference_->skipped()) << what;
    EXPECT_EQ(sharded_->loss_scale(), reference_->loss_scale()) << what;
    return failures;
  }

  // Steps 1 to `last` of both, stage 1 and 2 alternating, an Inf or a NaN
  // on step `poisoned`, compared after each (see expect_same) until one
  // differs.
  void run_steps(const std::string& what, int last, int poisoned, double tolerance) {
    int failures = 0;
    for (int s = 1; s <= last && failures == 0; ++s) {
      write_gradients(s, s == poisoned);
      step(s % 2 == 0);
      failures += expect_same(what + " step " + std::to_string(s), tolerance);
    }
  }

  // Both save their state: the files' `sections` are the same bytes (the
  // whole files when `whole_file`), and `held` is not empty in them (the
  // form under test wrote its section); the unsharded file loads into the
  // sharded optimizer with the step count `steps`, and one more step
  // (`next_step`'s gradients) still agrees within `tolerance`.
  void expect_the_unsharded_state(const std::string& what, std::initializer_list<const char*> sections,
                                  bool whole_file, const char* held, int64_t steps, int next_step, double tolerance) {
    const std::string sharded = shared_path(MPI_COMM_WORLD, "state_sharded");
    const std::string unsharded = shared_path(MPI_COMM_WORLD, "state_unsharded");
    sharded_->save(sharded);
    if (comm_.rank() == 0) reference_->save(unsharded);
    MPI_Barrier(MPI_COMM_WORLD);
    const StateFile a = StateFile::read(sharded), b = StateFile::read(unsharded);
    for (const char* section : sections) {
      EXPECT_TRUE(a.get(section) == b.get(section)) << what << ": section " << section;
    }
    if (whole_file) EXPECT_TRUE(file_bytes(sharded) == file_bytes(unsharded)) << what << ": the whole file";
    EXPECT_FALSE(a.get(held).empty()) << what << ": section " << held;
    sharded_->load(unsharded);  // the unsharded file back into the shards
    EXPECT_EQ(sharded_->step_count(), steps) << what;
    write_gradients(next_step);
    step(false);
    expect_same(what + " after the load", tolerance);
    MPI_Barrier(MPI_COMM_WORLD);
    if (comm_.rank() == 0) {
      std::remove(sharded.c_str());
      std::remove(unsharded.c_str());
    }
  }

 private:
  Communicator& comm_;
  RunSetup s_;
  ShardedLayout layout_;
  GradientArena weights_, grads_;
  std::vector<std::vector<double>> initial_;
  std::unique_ptr<Unsharded<Optimizer>> reference_;
  std::unique_ptr<Sharded<Optimizer>> sharded_;
};

// Every rank's `t` is the same, byte for byte.
inline void expect_same_on_every_rank(Communicator& comm, const TensorView& t, const std::string& what) {
  const std::vector<uint8_t> mine = bits(t);
  std::vector<uint8_t> all(mine.size() * static_cast<size_t>(comm.size()));
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(), static_cast<int>(mine.size()),
                MPI_BYTE, MPI_COMM_WORLD);
  for (int r = 0; r < comm.size(); ++r) {
    EXPECT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(mine.size()) * r))
        << what << ": rank " << r << " differs";
  }
}

class ShardedAdamTest : public OnEachBackend {};

struct Case {
  DType weights;
  DType grads;
  std::vector<int64_t> model;
  LossScaling scaling;
  int update_parts = 8;  // 1: one update launch; many: one per bucket
};

// A run of `c` with a dynamic scaler that moves often (when it is dynamic).
inline RunSetup setup_of(const Case& c) {
  RunSetup s;
  s.weights = c.weights;
  s.grads = c.grads;
  s.model = c.model;
  s.options.scaler.mode = c.scaling;
  s.options.scaler.initial_scale = 1024;
  s.options.scaler.growth_interval = 5;
  s.options.update_parts = c.update_parts;
  return s;
}

inline std::string name_of(const Case& c) {
  return std::string(dtype_name(c.weights)) + "/" + std::string(dtype_name(c.grads)) +
         (c.model.size() == kTiny.size() ? " tiny" : "") + " in " + std::to_string(c.update_parts) + " parts";
}

}  // namespace gradkit::test
