// libFuzzer target: a state file from untrusted hands, loaded by every
// optimizer that reads its kind: Adam (f32 moments with amsgrad, and bf16
// moments), LAMB, MixedPrecision<Adam> (f16) and MixedPrecision<Lamb> (bf16)
// with their loss scalers, and ShardedAdam and ShardedLamb (f32, one with a
// loss scaler; f16/bf16 with masters) over a one-rank MPI communicator, and
// Muon (each tensor a column matrix, one group with Nesterov and one without).
//
// The input's last 8 bytes are replaced by the checksum of the bytes before
// them, so that mutations get past the checksum to the sections. Besides
// what the sanitizers report (and any exception other than gradkit::Error,
// which ends the process), the target stops on:
// - a refusal with another code than io_error;
// - a refused file that changed the optimizer's state or the model's weights
//   (every load starts from the same state, loaded from the seed file);
// - an accepted file whose state, saved and loaded again, is not the same.
//
// With GRADKIT_FUZZ_SEEDS=DIR it first writes each optimizer's file (after
// two steps on seeded random gradients) to DIR: the seeds (scripts/fuzz).
#include <sanitizer/lsan_interface.h>

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/comm/gradient_arena.h"
#include "gradkit/core/error.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/muon.h"
#include "gradkit/optim/sharded.h"
#include "gradkit/optim/state_file.h"
#include "optim/state_file_checksum.h"

namespace gradkit::fuzz {
namespace {

// A small model of two groups (tensors 0-1 and 2-3) whose layout has three
// buckets, with padding between tensors: files of a few hundred bytes.
const std::vector<int64_t> kNumels = {5, 3, 4, 7};
const std::vector<size_t> kGroupOf = {0, 0, 1, 1};
constexpr int64_t kBucketElements = 6;
constexpr int64_t kAlignment = 4;

// Every section an optimizer's save_to writes.
constexpr const char* kSections[] = {"meta",    "groups", "exp_avg", "exp_avg_sq",     "max_exp_avg_sq",
                                     "masters", "scaler", "shapes",  "momentum_buffer"};

void fill_random(const TensorView& t, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<uint8_t> bytes(t.bytes());
  for (int64_t i = 0; i < t.numel; ++i) {
    const float v = normal(rng);
    const uint16_t bits = t.dtype == DType::f16 ? half(v).bits : bfloat16(v).bits;
    if (t.dtype == DType::f32) std::memcpy(bytes.data() + 4 * i, &v, 4);
    else std::memcpy(bytes.data() + 2 * i, &bits, 2);
  }
  copy_from_host(t.data, t.device, bytes.data(), bytes.size());
}

// What an optimizer's state is, as far as a load may change it: its
// sections as save_to writes them, and the model's weights.
using Snapshot = std::vector<std::vector<uint8_t>>;

class Case {
 public:
  Case(std::string name, std::string_view kind) : name_(std::move(name)), kind_(kind) {}
  virtual ~Case() = default;
  const std::string& name() const { return name_; }
  std::string_view kind() const { return kind_; }

  virtual void step() = 0;
  virtual void save(const std::string& path) = 0;
  virtual void load(const std::string& path) = 0;
  virtual void save_to(StateFile& file) = 0;
  virtual std::vector<TensorView> weights() const = 0;
  virtual std::vector<TensorView> grads() const = 0;

  Snapshot snapshot() {
    StateFile file;
    save_to(file);
    Snapshot s;
    for (const char* name : kSections) {
      s.push_back({static_cast<uint8_t>(file.has(name))});
      if (file.has(name)) s.push_back(file.get(name));
    }
    for (const TensorView& w : weights()) {
      s.emplace_back(w.bytes());
      copy_to_host(s.back().data(), w.data, w.bytes(), w.device);
    }
    return s;
  }

  // The state every input is loaded over: the file saved after two steps.
  std::string seed_path;
  Snapshot seed_state;

 private:
  std::string name_;
  std::string_view kind_;
};

template <class Optimizer>
class OptimizerCase final : public Case {
 public:
  using Group = typename Optimizer::Group;
  using Hyper = decltype(Group{}.hyperparameters);
  using Make = std::function<std::unique_ptr<Optimizer>(const ShardedLayout&, std::vector<Group>)>;

  // Weights and gradients in arenas of the sharded layout (for every case:
  // views at its offsets suit the unsharded optimizers as well).
  OptimizerCase(std::string name, std::string_view kind, DType weights, DType grads,
                const std::vector<Hyper>& hyper, const Make& make)
      : Case(std::move(name), kind),
        layout_(ShardedLayout::make(kNumels, 1, kBucketElements, kAlignment)),
        weights_(Device::cpu(), weights, layout_),
        grads_(Device::cpu(), grads, layout_) {
    std::mt19937 rng(17);
    for (const TensorView& w : weights_.gradients()) fill_random(w, rng);
    std::vector<Group> groups(hyper.size());
    for (size_t g = 0; g < hyper.size(); ++g) groups[g].hyperparameters = hyper[g];
    for (size_t i = 0; i < kNumels.size(); ++i) {
      groups[kGroupOf[i]].params.push_back(weights_[i]);
      groups[kGroupOf[i]].grads.push_back(grads_[i]);
    }
    optimizer_ = make(layout_, std::move(groups));
  }

  void step() override { optimizer_->step(); }
  void save(const std::string& path) override { optimizer_->save(path); }
  void load(const std::string& path) override { optimizer_->load(path); }
  void save_to(StateFile& file) override { optimizer_->save_to(file); }
  std::vector<TensorView> weights() const override {
    return {weights_.gradients().begin(), weights_.gradients().end()};
  }
  std::vector<TensorView> grads() const override { return {grads_.gradients().begin(), grads_.gradients().end()}; }

 private:
  ShardedLayout layout_;
  GradientArena weights_, grads_;
  std::unique_ptr<Optimizer> optimizer_;
};

std::vector<AdamHyperparameters> adam_groups(bool amsgrad) {
  std::vector<AdamHyperparameters> h(2);
  h[0].lr = 1e-2f;
  h[0].weight_decay = 0.01f;
  h[0].decay = WeightDecay::decoupled;
  h[1].lr = 2e-3f;
  h[1].amsgrad = amsgrad;
  return h;
}

std::vector<MuonHyperparameters> muon_groups() {
  std::vector<MuonHyperparameters> h(2);
  h[0].lr = 0.02;
  h[1].nesterov = false;
  h[1].adjust_lr = MuonLrAdjust::match_rms_adamw;
  return h;
}

std::vector<LambHyperparameters> lamb_groups() {
  std::vector<LambHyperparameters> h(2);
  h[0].lambda = 0.01f;
  h[1].ratio_max = 10.0f;
  return h;
}

LossScalerOptions dynamic_scaler() {
  LossScalerOptions o;
  o.initial_scale = 1024.0f;
  o.growth_interval = 3;
  o.hysteresis = 2;
  return o;
}

struct Harness {
  std::unique_ptr<MpiEnvironment> mpi;
  std::unique_ptr<Communicator> comm;
  std::vector<std::unique_ptr<Case>> cases;
  MemoryFile input;
  std::string directory;
  std::string resaved;  // an accepted file's state, saved again
};

Harness* harness = nullptr;

std::vector<std::unique_ptr<Case>> make_cases(Communicator& comm) {
  using MixedAdam = MixedPrecision<Adam>;
  using MixedLamb = MixedPrecision<Lamb>;
  std::vector<std::unique_ptr<Case>> cases;
  auto add = [&](auto case_pointer) { cases.push_back(std::move(case_pointer)); };

  add(std::make_unique<OptimizerCase<Adam>>("adam", "adam", DType::f32, DType::f32, adam_groups(true),
                                            [](const ShardedLayout&, std::vector<AdamGroup> g) {
                                              return std::make_unique<Adam>(std::move(g));
                                            }));
  add(std::make_unique<OptimizerCase<Adam>>("adam_bf16_moments", "adam", DType::f32, DType::bf16, adam_groups(false),
                                            [](const ShardedLayout&, std::vector<AdamGroup> g) {
                                              return std::make_unique<Adam>(std::move(g), AdamOptions{DType::bf16});
                                            }));
  add(std::make_unique<OptimizerCase<Lamb>>("lamb", "lamb", DType::f32, DType::f32, lamb_groups(),
                                            [](const ShardedLayout&, std::vector<LambGroup> g) {
                                              return std::make_unique<Lamb>(std::move(g), LambOptions{.eta = 0.05f});
                                            }));
  add(std::make_unique<OptimizerCase<MixedAdam>>(
      "mixed_adam_f16", "mixed_precision_adam", DType::f16, DType::f16, adam_groups(true),
      [](const ShardedLayout&, std::vector<AdamGroup> g) {
        return std::make_unique<MixedAdam>(std::move(g), MixedPrecisionOptions{.scaler = dynamic_scaler()});
      }));
  add(std::make_unique<OptimizerCase<MixedLamb>>(
      "mixed_lamb_bf16", "mixed_precision_lamb", DType::bf16, DType::bf16, lamb_groups(),
      [](const ShardedLayout&, std::vector<LambGroup> g) {
        return std::make_unique<MixedLamb>(std::move(g), MixedPrecisionOptions{.scaler = dynamic_scaler(), .max_norm = 1.0f});
      }));

  add(std::make_unique<OptimizerCase<Muon>>("muon", "muon", DType::f32, DType::f32, muon_groups(),
                                            [](const ShardedLayout&, std::vector<MuonGroup> g) {
                                              for (MuonGroup& group : g)
                                                for (const TensorView& p : group.params) group.shapes.push_back({1, p.numel, 1});
                                              return std::make_unique<Muon>(std::move(g));
                                            }));

  ShardedOptions scaled;
  scaled.scaler = dynamic_scaler();
  scaled.update_parts = 2;
  add(std::make_unique<OptimizerCase<ShardedAdam>>(
      "sharded_adam", "adam", DType::f32, DType::f32, adam_groups(true),
      [&comm, scaled](const ShardedLayout& layout, std::vector<AdamGroup> g) {
        return std::make_unique<ShardedAdam>(comm, layout, std::move(g), scaled);
      }));
  add(std::make_unique<OptimizerCase<ShardedAdam>>(
      "sharded_adam_f16", "mixed_precision_adam", DType::f16, DType::f16, adam_groups(false),
      [&comm, scaled](const ShardedLayout& layout, std::vector<AdamGroup> g) {
        return std::make_unique<ShardedAdam>(comm, layout, std::move(g), scaled);
      }));
  add(std::make_unique<OptimizerCase<ShardedLamb>>(
      "sharded_lamb", "lamb", DType::f32, DType::f32, lamb_groups(),
      [&comm](const ShardedLayout& layout, std::vector<LambGroup> g) {
        return std::make_unique<ShardedLamb>(comm, layout, std::move(g));
      }));
  add(std::make_unique<OptimizerCase<ShardedLamb>>(
      "sharded_lamb_bf16", "mixed_precision_lamb", DType::bf16, DType::bf16, lamb_groups(),
      [&comm](const ShardedLayout& layout, std::vector<LambGroup> g) {
        ShardedOptions o;
        o.max_norm = 1.0f;
        return std::make_unique<ShardedLamb>(comm, layout, std::move(g), o);
      }));
  return cases;
}

// Loads `path` into `c` over its seed state and checks what the load did.
void run(Case& c, const std::string& path) {
  c.load(c.seed_path);
  try {
    c.load(path);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::io_error) {
      finding(c.name() + " refused a file with " + std::string(error_code_name(e.code())) + ", expected io_error: " +
              e.what());
    }
    if (c.snapshot() != c.seed_state) finding(c.name() + " refused a file but changed its state: " + e.what());
    return;
  }
  const Snapshot loaded = c.snapshot();
  c.save(harness->resaved);
  c.load(c.seed_path);
  c.load(harness->resaved);
  if (c.snapshot() != loaded) finding(c.name() + " accepted a file whose state, saved and loaded again, differs");
}

}  // namespace
}  // namespace gradkit::fuzz

using namespace gradkit;
using namespace gradkit::fuzz;

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Open MPI allocates for good when it starts and when a collective is
  // first used (all of them are used here, for the seeds): not leaks of
  // gradkit's, and not checked. Every input's own allocations are.
  __lsan::ScopedDisabler open_mpi_start;
  harness = new Harness;
  harness->mpi = std::make_unique<MpiEnvironment>(argc, argv);
  harness->comm = create_mpi_communicator();
  harness->cases = make_cases(*harness->comm);
  harness->directory = make_temp_directory();
  harness->resaved = harness->directory + "/resaved";
  const std::string seeds = seed_directory();
  std::mt19937 rng(29);
  for (const auto& c : harness->cases) {
    for (int s = 0; s < 2; ++s) {
      for (const TensorView& g : c->grads()) fill_random(g, rng);
      c->step();
    }
    c->seed_path = harness->directory + "/" + c->name();
    c->save(c->seed_path);
    c->seed_state = c->snapshot();
    c->load(c->seed_path);
    if (c->snapshot() != c->seed_state) finding(c->name() + ": its own file does not load back to the same state");
    if (!seeds.empty()) write_file(seeds + "/" + c->name(), read_file(c->seed_path));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> bytes(data, data + size);
  if (bytes.size() >= 8) {
    const uint64_t sum = state_file_checksum(bytes.data(), bytes.size() - 8);
    std::memcpy(bytes.data() + bytes.size() - 8, &sum, 8);
  }
  harness->input.write(bytes.data(), bytes.size());
  // The kind picks the optimizers that read the file; a file no optimizer
  // reads goes to Adam, whose load must refuse it.
  std::string kind;
  try {
    const StateFile file = StateFile::read(harness->input.path());
    if (file.has("kind")) kind.assign(file.get("kind").begin(), file.get("kind").end());
  } catch (const Error& e) {
    if (e.code() != ErrorCode::io_error) finding(std::string("StateFile::read refused a file with ") + e.what());
    return 0;
  }
  bool read = false;
  for (const auto& c : harness->cases) {
    if (c->kind() != kind) continue;
    run(*c, harness->input.path());
    read = true;
  }
  if (!read) run(*harness->cases.front(), harness->input.path());
  return 0;
}
