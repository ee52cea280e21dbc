// The sharded Adam and LAMB steps (ZeRO stages 1 and 2) against the
// unsharded step on the same averaged gradients: Adam's weights bitwise
// equal over 50 steps with injected Inf/NaN, LAMB's moments bitwise and its
// weights to f32 roundoff, on every rank; the layout; the state file (byte
// for byte the unsharded optimizer's, loaded onto other rank counts); bad
// input.
// Gradients are multiples of a power of two small enough that their sum over
// ranks is exact in every dtype, so that a reduce-scatter and an all-reduce
// give the same bits whatever their order of additions.
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
#include "gradkit/ops/blockwise.h"
#include "gradkit/ops/grad_check.h"
#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/sharded.h"
#include "gradkit/optim/state_file.h"
#include "support/test_tensor.h"
#include "support/tolerance.h"

namespace gradkit::test {
namespace {

const std::vector<int64_t> kModel = {1000, 37, 3, 4096, 129, 1, 700};
const std::vector<int64_t> kTiny = {3, 5};  // with 4 ranks, two own only padding

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
std::vector<double> values(const TensorView& t) {
  TestTensor host(Device::cpu(), t.dtype, std::vector<double>(static_cast<size_t>(t.numel), 0.0));
  copy_to_host(host.view().data, t.data, t.bytes(), t.device);
  return host.read();
}

void put(const TensorView& t, const std::vector<double>& values) {
  const TestTensor host(Device::cpu(), t.dtype, values);
  copy_from_host(t.data, t.device, host.view().data, t.bytes());
}

std::vector<uint8_t> bits(const TensorView& t) {
  std::vector<uint8_t> b(t.bytes());
  copy_to_host(b.data(), t.data, t.bytes(), t.device);
  return b;
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A path every rank of `comm` agrees on (rank 0's process id in it).
std::string shared_path(MPI_Comm comm, const std::string& name) {
  int pid = static_cast<int>(getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, comm);
  return "/tmp/gradkit_sharded_" + name + "_" + std::to_string(pid) + ".state";
}

// Rank `rank`'s gradient of tensor `t` at step `step`: multiples of 2^-q in
// [-4, 4] (q by dtype), so that sums over up to 4 ranks are exact.
std::vector<double> gradient(uint64_t seed, int step, int rank, size_t t, int64_t n, DType dtype) {
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
void expect_same_on_every_rank(Communicator& comm, const TensorView& t, const std::string& what) {
  const std::vector<uint8_t> mine = bits(t);
  std::vector<uint8_t> all(mine.size() * static_cast<size_t>(comm.size()));
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(), static_cast<int>(mine.size()),
                MPI_BYTE, MPI_COMM_WORLD);
  for (int r = 0; r < comm.size(); ++r) {
    EXPECT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(mine.size()) * r))
        << what << ": rank " << r << " differs";
  }
}

TEST(ShardedLayout, EveryElementBelongsToExactlyOneRank) {
  for (int world : {1, 2, 3, 4}) {
    for (int64_t bucket : {int64_t{0}, int64_t{1}, int64_t{1500}, int64_t{1} << 20}) {
      const ShardedLayout layout = ShardedLayout::make(kModel, world, bucket);
      std::vector<std::vector<int>> owners(kModel.size());
      for (size_t t = 0; t < kModel.size(); ++t) owners[t].assign(static_cast<size_t>(kModel[t]), 0);
      for (int r = 0; r < world; ++r) {
        for (const ShardedLayout::Piece& p : layout.pieces(r)) {
          const int64_t flat = layout.offsets[p.tensor] + p.offset;
          EXPECT_EQ(flat, layout.slice_begin(p.bucket, r) + p.in_slice);
          EXPECT_LE(p.in_slice + p.count, layout.buckets[p.bucket].slice);
          for (int64_t k = 0; k < p.count; ++k) ++owners[p.tensor][static_cast<size_t>(p.offset + k)];
        }
      }
      for (size_t t = 0; t < kModel.size(); ++t) {
        EXPECT_EQ(layout.offsets[t] % layout.alignment, 0) << "tensor " << t;
        for (int n : owners[t]) ASSERT_EQ(n, 1) << "world " << world << " bucket " << bucket << " tensor " << t;
      }
      int64_t end = 0;
      for (const ShardedLayout::Bucket& b : layout.buckets) {
        EXPECT_EQ(b.begin, end);
        EXPECT_EQ(b.slice % layout.alignment, 0);
        end = b.begin + b.slice * world;
        EXPECT_GE(end, layout.offsets[b.last - 1] + kModel[b.last - 1]);
      }
      EXPECT_EQ(end, layout.total);
      if (bucket == 0) EXPECT_EQ(layout.buckets.size(), 1u);
      if (bucket == 1) EXPECT_EQ(layout.buckets.size(), kModel.size());
    }
  }
}

TEST(ShardedLayout, RejectsBadArguments) {
  expect_error([] { ShardedLayout::make(kModel, 0); }, ErrorCode::invalid_argument, {"'world_size'", ">= 1"});
  expect_error([] { ShardedLayout::make(kModel, 2, -1); }, ErrorCode::invalid_argument, {"'bucket_elements'"});
  expect_error([] { ShardedLayout::make(kModel, 2, 0, 48); }, ErrorCode::invalid_argument, {"'alignment'", "power of two"});
  const std::vector<int64_t> negative = {4, -2};
  expect_error([&] { ShardedLayout::make(negative, 2); }, ErrorCode::invalid_argument, {"'numels[1]'", "-2"});
  // A layout edited by hand is refused by its users, naming the field.
  const ShardedLayout good = ShardedLayout::make(kModel, 2, 1500);
  ShardedLayout bad = good;
  bad.offsets[3] = good.offsets[2];  // on top of tensor 2
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument,
               {"'layout.offsets[3]'"});
  bad = good;
  bad.total += 1;
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument, {"'layout.total'"});
  bad = good;
  bad.buckets[1].begin += 64;
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument,
               {"'layout.buckets[1]'"});
  bad = good;
  bad.buckets.pop_back();
  expect_error([&] { GradientArena(Device::cpu(), DType::f32, bad); }, ErrorCode::invalid_argument, {"'layout.buckets'"});
  for (int world : {1, 2, 3, 4}) {
    for (int64_t bucket : {int64_t{0}, int64_t{1}, int64_t{1500}}) EXPECT_NO_THROW(ShardedLayout::make(kModel, world, bucket).validate("t"));
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
RunSetup setup_of(const Case& c) {
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

std::string name_of(const Case& c) {
  return std::string(dtype_name(c.weights)) + "/" + std::string(dtype_name(c.grads)) +
         (c.model.size() == kTiny.size() ? " tiny" : "") + " in " + std::to_string(c.update_parts) + " parts";
}

// 50 steps, stage 1 and stage 2 alternating, with Inf/NaN on steps 7, 20
// and 33, an lr change at step 25: bitwise the unsharded weights after every
// step, the same skipped steps and loss scales, identical on every rank.
TEST_P(ShardedAdamTest, EqualsTheUnshardedStepBitwise) {
  const Case cases[] = {{DType::f32, DType::f32, kModel, LossScaling::none},
                        {DType::f32, DType::f32, kModel, LossScaling::none, 1},
                        {DType::f16, DType::f16, kModel, LossScaling::dynamic, 1000},
                        {DType::bf16, DType::f32, kModel, LossScaling::none, 2},
                        {DType::f32, DType::bf16, kTiny, LossScaling::none},
                        {DType::f16, DType::f32, kTiny, LossScaling::dynamic}};
  for (const Case& c : cases) {
    Pair<> pair(comm(), setup_of(c));
    const std::string name = name_of(c);
    int failures = 0;
    for (int step = 1; step <= 50 && failures == 0; ++step) {
      if (step == 25) {
        Kind<Adam>::set_rate(pair.sharded(), 5e-3f);
        pair.reference().set_rate(5e-3f);
      }
      pair.write_gradients(step, step == 7 || step == 20 || step == 33);
      pair.step(step % 2 == 0);
      failures += pair.expect_same(name + " step " + std::to_string(step));
      if (step == 7 || step == 20 || step == 33) EXPECT_TRUE(pair.sharded().last_step_skipped()) << name;
    }
    EXPECT_EQ(pair.sharded().step_count(), 47) << name;  // three skipped
    expect_same_on_every_rank(comm(), pair.weights().buffer().view(c.weights, 0, pair.layout().total), name);
  }
}

// With clipping the global norm is summed per rank, then across ranks: it
// agrees with the unsharded norm to f64 rounding, and the weights to a few
// units of f32 roundoff; every rank still holds the same bits.
TEST_P(ShardedAdamTest, ClipsByTheGlobalNormOfAllRanks) {
  RunSetup s;
  s.options.max_norm = 1.0f;
  Pair<> pair(comm(), s);
  for (int step = 1; step <= 10; ++step) {
    pair.write_gradients(step);
    pair.step(false);
    const float norm = pair.sharded().last_grad_norm();
    EXPECT_GT(norm, 1.0f);  // clipping happens
    EXPECT_NEAR(norm, pair.reference().norm(), 1e-6 * norm);
  }
  for (size_t i = 0; i < kModel.size(); ++i) {
    const TestTensor got(Device::cpu(), DType::f32, std::vector<double>(static_cast<size_t>(kModel[i])));
    copy_to_host(got.view().data, pair.weights()[i].data, pair.weights()[i].bytes(), comm().device());
    const TestTensor want(Device::cpu(), DType::f32, std::vector<double>(static_cast<size_t>(kModel[i])));
    copy_to_host(want.view().data, pair.reference().weights()[i].data, pair.weights()[i].bytes(), comm().device());
    const std::vector<double> a = got.read(), b = want.read();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 1e-5 * std::abs(b[k]) + 1e-7) << i << "/" << k;
  }
  expect_same_on_every_rank(comm(), pair.weights().buffer().view(DType::f32, 0, pair.layout().total), "clipped");
}

TEST_P(ShardedAdamTest, HoldsOnlyItsShardOfTheState) {
  RunSetup s;
  s.weights = DType::f16;
  s.grads = DType::f16;
  Pair<> pair(comm(), s);
  int64_t mine = 0;
  for (const ShardedLayout::Piece& p : pair.sharded().pieces()) mine += p.count;
  // 12 bytes per element of its pieces (f32 master, two f32 moments), each
  // piece's state starting on a 256-byte boundary.
  EXPECT_GE(pair.sharded().state_bytes(), static_cast<size_t>(mine) * 12);
  EXPECT_LE(pair.sharded().state_bytes(), static_cast<size_t>(mine) * 12 + 3 * 256 * pair.sharded().pieces().size() + 3 * 256);
  EXPECT_LE(mine, pair.layout().shard_elements());
}

// The file is the unsharded optimizer's, byte for byte, with and without
// amsgrad, f32 and f16 weights.
TEST_P(ShardedAdamTest, SavesTheUnshardedFileByteForByte) {
  for (DType weights : {DType::f32, DType::f16}) {
    for (bool amsgrad : {false, true}) {
      RunSetup s;
      s.weights = weights;
      s.grads = weights;
      s.amsgrad = amsgrad;
      s.options.scaler.mode = weights == DType::f16 ? LossScaling::dynamic : LossScaling::none;
      Pair<> pair(comm(), s);
      for (int step = 1; step <= 6; ++step) {
        pair.write_gradients(step, step == 3);
        pair.step(step % 2 == 0);
      }
      const std::string sharded = shared_path(MPI_COMM_WORLD, "sharded");
      const std::string unsharded = shared_path(MPI_COMM_WORLD, "unsharded");
      pair.sharded().save(sharded);
      if (comm().rank() == 0) pair.reference().save(unsharded);
      MPI_Barrier(MPI_COMM_WORLD);
      const std::vector<uint8_t> a = file_bytes(sharded), b = file_bytes(unsharded);
      EXPECT_FALSE(a.empty());
      EXPECT_TRUE(a == b) << dtype_name(weights) << " amsgrad " << amsgrad << ": " << a.size() << " vs " << b.size()
                          << " bytes";
      MPI_Barrier(MPI_COMM_WORLD);
      if (comm().rank() == 0) {
        std::remove(sharded.c_str());
        std::remove(unsharded.c_str());
      }
    }
  }
}

// A communicator of the first `n` ranks of the world (null on the others).
std::unique_ptr<Communicator> first_ranks(Backend backend, int n, MPI_Comm* out) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_split(MPI_COMM_WORLD, rank < n ? 0 : MPI_UNDEFINED, rank, out);
  if (*out == MPI_COMM_NULL) return nullptr;
  return make_communicator(backend, {}, mpi_comm_handle(*out));
}

// State saved on `from` ranks loads onto `to` ranks (and onto the unsharded
// optimizer), and the runs go on bitwise alike.
void expect_reshards(Backend backend, int from, int to, DType weights) {
  RunSetup s;
  s.weights = weights;
  s.grads = weights;
  s.options.scaler.mode = weights == DType::f32 ? LossScaling::none : LossScaling::dynamic;
  const std::string path = shared_path(MPI_COMM_WORLD, "reshard");
  const std::string name = std::to_string(from) + " to " + std::to_string(to) + " ranks, " + std::string(dtype_name(weights));
  std::vector<uint8_t> saved_weights;
  {
    MPI_Comm sub = MPI_COMM_NULL;
    auto comm = first_ranks(backend, from, &sub);
    if (comm) {
      Pair<> pair(*comm, s);
      for (int step = 1; step <= 5; ++step) {
        pair.write_gradients(step);
        pair.step(false);
      }
      pair.sharded().save(path);
      if (comm->rank() == 0) saved_weights = bits(pair.weights().flat());
      comm.reset();
      MPI_Comm_free(&sub);
    }
  }
  // The weights go with the model (f32 models: not in the file).
  int size = static_cast<int>(saved_weights.size());
  MPI_Bcast(&size, 1, MPI_INT, 0, MPI_COMM_WORLD);
  saved_weights.resize(static_cast<size_t>(size));
  MPI_Bcast(saved_weights.data(), size, MPI_BYTE, 0, MPI_COMM_WORLD);
  {
    MPI_Comm sub = MPI_COMM_NULL;
    auto comm = first_ranks(backend, to, &sub);
    if (comm) {
      Pair<> pair(*comm, s);  // a new layout for `to` ranks; offsets within tensors alike
      if (weights == DType::f32) {
        // Same tensor order and alignment, another padding: copy tensor by tensor.
        const ShardedLayout old_layout = ShardedLayout::make(s.model, from, s.bucket_elements);
        for (size_t i = 0; i < s.model.size(); ++i) {
          const auto* at = saved_weights.data() + (old_layout.offsets[i] - old_layout.offsets[0]) * 4;
          copy_from_host(pair.weights()[i].data, comm->device(), at, pair.weights()[i].bytes());
          copy_from_host(pair.reference().weights()[i].data, comm->device(), at, pair.weights()[i].bytes());
        }
      }
      pair.sharded().load(path);
      pair.reference().load(path);
      EXPECT_EQ(pair.sharded().step_count(), 5) << name;
      pair.expect_same(name + " after load");
      for (int step = 6; step <= 10; ++step) {
        pair.write_gradients(step);
        pair.step(step % 2 == 0);
        if (pair.expect_same(name + " step " + std::to_string(step)) > 0) break;
      }
      comm.reset();
      MPI_Comm_free(&sub);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::remove(path.c_str());
}

TEST_P(ShardedAdamTest, LoadsOntoAnotherNumberOfRanks) {
  const int world = comm().size();
  for (DType weights : {DType::f32, DType::f16}) {
    expect_reshards(GetParam(), world, 1, weights);  // onto one rank: the unsharded layout
    expect_reshards(GetParam(), 1, world, weights);  // an unsharded run's file onto every rank
    if (world >= 4) expect_reshards(GetParam(), 4, 2, weights);
    if (world >= 3) expect_reshards(GetParam(), 2, 3, weights);
  }
}

TEST_P(ShardedAdamTest, RefusesAFileOfAnotherModelOnEveryRankWritingNothing) {
  RunSetup s;
  Pair<> pair(comm(), s);
  pair.write_gradients(1);
  pair.step(false);
  RunSetup other = s;
  other.model = kTiny;
  Pair<> small(comm(), other);
  const std::string path = shared_path(MPI_COMM_WORLD, "other");
  small.sharded().save(path);
  const std::vector<uint8_t> before = bits(pair.weights().flat());
  expect_error([&] { pair.sharded().load(path); }, ErrorCode::io_error, {path, "does not match"});
  expect_error([&] { pair.sharded().load(path + ".missing"); }, ErrorCode::io_error, {".missing"});
  EXPECT_EQ(pair.sharded().step_count(), 1);
  EXPECT_TRUE(bits(pair.weights().flat()) == before);
  // An unwritable path: every rank hears of rank 0's failure.
  expect_error([&] { pair.sharded().save("/nonexistent-dir/x.state"); }, ErrorCode::io_error,
               {comm().rank() == 0 ? "/nonexistent-dir/x.state" : "other rank"});
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm().rank() == 0) std::remove(path.c_str());
}

TEST_P(ShardedAdamTest, RejectsBadArgumentsNamingThem) {
  const ShardedLayout layout = ShardedLayout::make(kModel, comm().size(), 1500);
  const GradientArena weights(comm().device(), DType::f32, layout), grads(comm().device(), DType::f32, layout);
  auto groups = [&] { return groups_of(weights.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false)); };

  const ShardedLayout wrong_world = ShardedLayout::make(kModel, comm().size() + 1, 1500);
  expect_error([&] { ShardedAdam(comm(), wrong_world, groups()); }, ErrorCode::invalid_argument,
               {"'layout'", "comm.size()"});
  // Gradients that are not views of one buffer laid out by the layout.
  const GradientArena loose(comm().device(), DType::f32, kModel, 4);  // back to back
  expect_error([&] { ShardedAdam(comm(), layout, groups_of(weights.gradients(), loose.gradients(), Kind<Adam>::hyperparameters(false))); },
               ErrorCode::invalid_argument, {"grads[1]", "not at element"});
  auto with_copy = groups();
  with_copy[1].model_copy = with_copy[1].params;
  expect_error([&] { ShardedAdam(comm(), layout, with_copy); }, ErrorCode::invalid_argument, {"groups[1].model_copy"});
  const GradientArena doubles(comm().device(), DType::f64, layout);
  expect_error([&] { ShardedAdam(comm(), layout, groups_of(doubles.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false))); },
               ErrorCode::dtype_unsupported, {"params", "f64"});
  const std::vector<int64_t> fewer(kModel.begin(), kModel.end() - 1);
  expect_error([&] { ShardedAdam(comm(), ShardedLayout::make(fewer, comm().size()), groups()); },
               ErrorCode::size_mismatch, {"params", "the layout's"});

  ShardedOptions no_parts;
  no_parts.update_parts = 0;
  expect_error([&] { ShardedAdam(comm(), layout, groups(), no_parts); }, ErrorCode::invalid_argument,
               {"'options.update_parts'", ">= 1"});

  ShardedAdam adam(comm(), layout, groups());
  adam.mark_ready(2);
  expect_error([&] { adam.mark_ready(2); }, ErrorCode::invalid_argument, {"'gradient'", "already marked"});
  expect_error([&] { adam.mark_ready(kModel.size()); }, ErrorCode::invalid_argument, {"'gradient'", "below"});
}

// LAMB: the moments are element-wise, so bitwise the unsharded step's (its
// state file's moment sections, byte for byte); each trust ratio adds every
// rank's partial sums in rank order, so the weights agree with the
// unsharded step's to f32 roundoff (f16/bf16 weights: to their own
// rounding); the same skipped steps and scales; identical on every rank.
TEST_P(ShardedAdamTest, LambMatchesTheUnshardedLamb) {
  const Case cases[] = {{DType::f32, DType::f32, kModel, LossScaling::none},
                        {DType::f16, DType::f16, kModel, LossScaling::dynamic, 1000},
                        {DType::f32, DType::bf16, kTiny, LossScaling::none, 1}};
  for (const Case& c : cases) {
    RunSetup s = setup_of(c);
    s.options.lamb.eta = 1e-2f;
    Pair<Lamb> pair(comm(), s);
    const std::string name = "LAMB " + name_of(c);
    const double tolerance = c.weights == DType::f32 ? 1e-6 : 2 * elementwise_tolerance(c.weights).relative;
    int failures = 0;
    for (int step = 1; step <= 30 && failures == 0; ++step) {
      if (step == 15) {
        Kind<Lamb>::set_rate(pair.sharded(), 5e-3f);
        pair.reference().set_rate(5e-3f);
      }
      pair.write_gradients(step, step == 7 || step == 20);
      pair.step(step % 2 == 0);
      failures += pair.expect_same(name + " step " + std::to_string(step), tolerance);
    }
    EXPECT_EQ(pair.sharded().step_count(), 28) << name;  // two skipped
    EXPECT_FLOAT_EQ(pair.sharded().eta(), 5e-3f) << name;
    expect_same_on_every_rank(comm(), pair.weights().buffer().view(c.weights, 0, pair.layout().total), name);

    const std::string sharded = shared_path(MPI_COMM_WORLD, "lamb_sharded");
    const std::string unsharded = shared_path(MPI_COMM_WORLD, "lamb_unsharded");
    pair.sharded().save(sharded);
    if (comm().rank() == 0) pair.reference().save(unsharded);
    MPI_Barrier(MPI_COMM_WORLD);
    const StateFile a = StateFile::read(sharded), b = StateFile::read(unsharded);
    for (const char* section : {"exp_avg", "exp_avg_sq", "meta", "groups"}) {
      EXPECT_TRUE(a.get(section) == b.get(section)) << name << ": section " << section;
    }
    // f32 models: no masters, so the whole file is the unsharded one.
    if (c.weights == DType::f32) EXPECT_TRUE(file_bytes(sharded) == file_bytes(unsharded)) << name;
    // The unsharded file loads into the sharded LAMB (the same state back).
    pair.sharded().load(unsharded);
    EXPECT_EQ(pair.sharded().step_count(), 28) << name;
    MPI_Barrier(MPI_COMM_WORLD);
    if (comm().rank() == 0) {
      std::remove(sharded.c_str());
      std::remove(unsharded.c_str());
    }
  }
}

// 8-bit moments on a layout aligned to kQuantBlock: every shard holds whole
// blocks, so Adam's weights are bitwise the unsharded step's and LAMB's
// moments (codes and absmax) are; the state file is the unsharded one's
// (absmax sections included); a layout not aligned to blocks is refused.
TEST_P(ShardedAdamTest, EightBitMomentsMatchTheUnshardedStep) {
  const std::vector<int64_t> model = {1000, 37, 3, 4096, 129, 1, 700};
  const Case cases[] = {{DType::f32, DType::f32, model, LossScaling::none},
                        {DType::f16, DType::f16, model, LossScaling::dynamic, 2},
                        {DType::bf16, DType::f32, kTiny, LossScaling::none, 1}};
  for (bool lamb : {false, true}) {
    for (const Case& c : cases) {
      RunSetup s = setup_of(c);
      s.alignment = kQuantBlock;
      s.options.adam.moment_dtype = DType::u8;
      s.options.lamb.moment_dtype = DType::u8;
      s.options.lamb.eta = 1e-2f;
      const std::string name = std::string(lamb ? "LAMB " : "Adam ") + "8-bit " + name_of(c);
      auto run = [&](auto& pair, double tolerance) {
        int failures = 0;
        for (int step = 1; step <= 12 && failures == 0; ++step) {
          pair.write_gradients(step, step == 7);
          pair.step(step % 2 == 0);
          failures += pair.expect_same(name + " step " + std::to_string(step), tolerance);
        }
        EXPECT_EQ(pair.sharded().step_count(), 11) << name;
        pair.expect_the_unsharded_state(
            name, {"exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "meta", "groups"}, false,
            "exp_avg_absmax", 11, 13, tolerance);
      };
      if (lamb) {
        Pair<Lamb> pair(comm(), s);
        run(pair, c.weights == DType::f32 ? 1e-6 : 2 * elementwise_tolerance(c.weights).relative);
      } else {
        Pair<> pair(comm(), s);
        run(pair, 0);
      }
    }
  }
  const ShardedLayout cutting = ShardedLayout::make(model, comm().size(), 1500, 64);
  const GradientArena weights(comm().device(), DType::f32, cutting), grads(comm().device(), DType::f32, cutting);
  ShardedOptions u8;
  u8.adam.moment_dtype = DType::u8;
  expect_error([&] { ShardedAdam(comm(), cutting, groups_of(weights.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false)), u8); },
               ErrorCode::invalid_argument, {"'layout.alignment'", "is 64", "options.adam.moment_dtype", "multiple of 256"});
}

// Remainder masters (bf16 models): each rank keeps an i16 remainder per
// element of its shard instead of an f32 master. Adam's weights and
// remainders are bitwise the unsharded MixedPrecision<Adam> with remainder
// masters (f32 and 8-bit moments), LAMB's within its usual tolerance with
// the moments bitwise; the state is 2 bytes an element smaller than with
// f32 masters; the file is the unsharded one's (f32 masters, joined), byte
// for byte for Adam, and it loads back and the run goes on alike. f16
// weights are refused naming the tensor.
TEST_P(ShardedAdamTest, RemainderMastersMatchTheUnshardedStep) {
  const Case cases[] = {{DType::bf16, DType::bf16, kModel, LossScaling::none},
                        {DType::bf16, DType::f32, kTiny, LossScaling::none, 1}};
  for (bool lamb : {false, true}) {
    for (DType moments : {DType::f32, DType::u8}) {
      if (lamb && moments == DType::u8) continue;  // LAMB's remainder takes float moments
      for (const Case& c : cases) {
        RunSetup s = setup_of(c);
        s.alignment = kQuantBlock;
        s.options.master = MasterStorage::remainder;
        s.options.adam.moment_dtype = moments;
        s.options.lamb.eta = 1e-2f;
        const std::string name = std::string(lamb ? "LAMB " : "Adam ") + std::string(dtype_name(moments)) +
                                 " moments, remainder masters, " + name_of(c);
        auto run = [&](auto& pair, double tolerance) {
          int64_t mine = 0;
          for (const ShardedLayout::Piece& p : pair.sharded().pieces()) mine += p.count;
          const size_t per_element = 2 + 2 * (moments == DType::u8 ? 1 : 4);  // remainder, two moments
          EXPECT_GE(pair.sharded().state_bytes(), static_cast<size_t>(mine) * per_element) << name;
          EXPECT_LE(pair.sharded().state_bytes(),
                    static_cast<size_t>(mine) * (per_element + 1) + 5 * 256 * (pair.sharded().pieces().size() + 1))
              << name;
          EXPECT_TRUE(pair.sharded().masters().empty()) << name;
          EXPECT_EQ(pair.sharded().weight_remainders().size(), std::max<size_t>(1, pair.sharded().pieces().size()));
          int failures = 0;
          for (int step = 1; step <= 20 && failures == 0; ++step) {
            pair.write_gradients(step, step == 7);
            pair.step(step % 2 == 0);
            failures += pair.expect_same(name + " step " + std::to_string(step), tolerance);
          }
          EXPECT_EQ(pair.sharded().step_count(), 19) << name;
          expect_same_on_every_rank(comm(), pair.weights().buffer().view(c.weights, 0, pair.layout().total), name);
          // Adam: the whole file, its masters joined alike; the loaded masters split back into
          // weights and remainders.
          pair.expect_the_unsharded_state(name, {"exp_avg", "exp_avg_sq", "meta", "groups"}, !lamb, "masters", 19, 21,
                                          tolerance);
        };
        if (lamb) {
          Pair<Lamb> pair(comm(), s);
          run(pair, 2 * elementwise_tolerance(c.weights).relative);
        } else {
          Pair<> pair(comm(), s);
          run(pair, 0);
        }
      }
    }
  }
  const ShardedLayout layout = ShardedLayout::make(kModel, comm().size(), 1500);
  const GradientArena weights(comm().device(), DType::f16, layout), grads(comm().device(), DType::f16, layout);
  ShardedOptions remainder;
  remainder.master = MasterStorage::remainder;
  expect_error([&] { ShardedAdam(comm(), layout, groups_of(weights.gradients(), grads.gradients(), Kind<Adam>::hyperparameters(false)), remainder); },
               ErrorCode::dtype_unsupported, {"'groups[0].params[0]'", "has dtype f16", "expected bf16", "options.master"});
}

GRADKIT_INSTANTIATE_ON_EACH_BACKEND(ShardedAdamTest);

}  // namespace
}  // namespace gradkit::test
