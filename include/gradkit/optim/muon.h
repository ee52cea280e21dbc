// An owning Muon optimizer over parameter groups, beside gradkit::Adam and
// gradkit::Lamb: it holds the momentum buffers and the step count in device
// memory, steps through one MuonPlan, and saves and loads its state
// bit-exactly (docs/state-format.md, kind "muon").
#pragma once

#include <string>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/ops/muon.h"

namespace gradkit {

struct StateSection;  // src/optim/moment_storage.h
class StateFile;

struct MuonGroup {
  std::vector<TensorView> params;    // f32 or bf16 matrices (or stacks of them), updated in place
  std::vector<TensorView> grads;     // f32, f16 or bf16, one per param
  std::vector<MatrixShape> shapes;   // one per param: (batch, rows, cols)
  std::vector<TensorView> model_copy;  // not taken by Muon: must stay empty (the shared group checks read it)
  MuonHyperparameters hyperparameters;
};

struct MuonOptions {
  DType momentum_dtype = DType::f32;  // f32 or bf16
  MuonPlanOptions plan;
};

// Per-step inputs of the owning optimizer (all optional).
struct MuonStep {
  const bool* found_inf = nullptr;  // true when the step runs: nothing changes, the count included
  float grad_scale = 1.0f;          // gradients are divided by this
  const float* grad_scale_device = nullptr;
};

class Muon {
 public:
  using Group = MuonGroup;
  using Options = MuonOptions;

  explicit Muon(std::vector<MuonGroup> groups, MuonOptions options = {});

  void step(Stream stream = {}, const MuonStep& inputs = {});

  int64_t step_count() const;  // completed updates (synchronous read)
  // Replaces group `group`'s hyperparameters (a learning-rate schedule).
  void set_hyperparameters(int group, const MuonHyperparameters& hyperparameters);
  const MuonHyperparameters& hyperparameters(int group) const;

  const std::vector<TensorView>& momentum() const { return momentum_; }
  // NorMuon's second moments, one per param (muon_second_moment_numel;
  // read and written only by groups with second_moment).
  const std::vector<TensorView>& second_moment() const { return second_moment_; }
  const MuonPlan& plan() const { return plan_; }
  // Bytes of optimizer-owned state (momentum buffers, second moments, counter); the plan's
  // workspace is plan().workspace_bytes().
  size_t state_bytes() const { return state_.bytes() + second_state_.bytes() + counter_.bytes(); }

  void save(const std::string& path) const;
  void load(const std::string& path);
  // As for Adam: the state as sections of a larger file.
  void save_to(StateFile& file) const;
  void check_state(const std::string& path, const StateFile& file) const;
  void apply_state(const StateFile& file);

 private:
  std::vector<StateSection> sections() const;
  std::vector<StateSection> recipe_sections() const;
  std::vector<uint8_t> recipe_section() const;
  std::vector<MuonHyperparameters> read_hyperparameters_of(const std::string& path, const StateFile& file) const;
  std::vector<uint8_t> shapes_section() const;

  std::vector<MuonGroup> groups_;
  MuonOptions options_;
  Device device_;
  Buffer state_;
  Buffer counter_;  // int64: completed updates
  std::vector<TensorView> momentum_;
  Buffer second_state_;
  std::vector<TensorView> second_moment_;
  MuonPlan plan_;
};

}  // namespace gradkit
