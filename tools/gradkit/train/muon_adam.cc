#include "train/muon_adam.h"

#include <string_view>
#include <utility>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/optim/state_file.h"
#include "train/mlp.h"
#include "train/optimizers.h"

namespace gradkit::train {
namespace {

constexpr std::string_view kMuonPrefix = "muon.", kAdamPrefix = "adam.";

MuonHyperparameters muon_hyperparameters(const TrainOptions& o, float lr) {
  MuonHyperparameters h;
  h.lr = lr;
  h.weight_decay = o.weight_decay;
  h.adjust_lr = MuonLrAdjust::match_rms_adamw;
  return h;
}

// The weight matrices but the last layer's: Muon's (shapes from the widths).
MuonGroup muon_group(const TrainOptions& o, std::span<const TensorView> params, std::span<const TensorView> grads) {
  MuonGroup g;
  const size_t layers = o.widths.size() - 1;
  for (size_t l = 0; l + 1 < layers; ++l) {
    g.params.push_back(params[2 * l]);
    g.grads.push_back(grads[2 * l]);
    g.shapes.push_back({1, o.widths[l + 1], o.widths[l]});  // W (out x in)
  }
  g.hyperparameters = muon_hyperparameters(o, o.lr);
  return g;
}

// The rest: every bias and the last layer's weights.
AdamGroup adam_group(const TrainOptions& o, std::span<const TensorView> params, std::span<const TensorView> grads) {
  const size_t last = 2 * (o.widths.size() - 2);  // the last layer's weight matrix
  std::vector<TensorView> p, g;
  for (size_t i = 0; i < params.size(); ++i) {
    if (i % 2 == 1 || i == last) {
      p.push_back(params[i]);
      g.push_back(grads[i]);
    }
  }
  return one_group<AdamGroup>(o, p, g);
}

MuonOptions muon_options(const TrainOptions& o) {
  MuonOptions options;
  options.momentum_dtype = o.moments == "bf16" ? DType::bf16 : DType::f32;
  return options;
}

// The sections of `file` under `prefix`, without it: the file the optimizer wrote.
StateFile unprefixed(const StateFile& file, std::string_view prefix) {
  StateFile out;
  for (const std::string& name : file.names()) {
    if (name.starts_with(prefix)) out.add(name.substr(prefix.size()), file.get(name));
  }
  return out;
}

template <class O>
void add_prefixed(StateFile& file, const O& optimizer, std::string_view prefix) {
  StateFile own;
  optimizer.save_to(own);
  for (const std::string& name : own.names()) file.add(std::string(prefix) + name, own.get(name));
}

}  // namespace

MuonWithAdam::MuonWithAdam(const TrainOptions& o, std::span<const TensorView> params, std::span<const TensorView> grads)
    : muon_({muon_group(o, params, grads)}, muon_options(o)), adam_({adam_group(o, params, grads)}, adam_options(o)) {}

void MuonWithAdam::step() {
  muon_.step();
  adam_.step();
}

void MuonWithAdam::set_lr(float lr) {
  MuonHyperparameters h = muon_.hyperparameters(0);
  h.lr = lr;
  muon_.set_hyperparameters(0, h);
  adam_.set_lr(0, lr);
}

void MuonWithAdam::save_to(StateFile& file) {
  add_prefixed(file, muon_, kMuonPrefix);
  add_prefixed(file, adam_, kAdamPrefix);
}

void MuonWithAdam::check_state(const std::string& path, const StateFile& file) const {
  // The sub-files have no path of their own: a refusal names the checkpoint and the prefix.
  auto check = [&](const auto& optimizer, std::string_view prefix) {
    try {
      optimizer.check_state(path, unprefixed(file, prefix));
    } catch (const Error& e) {
      throw Error(e.code(), "checkpoint '" + path + "', its '" + std::string(prefix) + "' sections: " + e.what());
    }
  };
  check(muon_, kMuonPrefix);
  check(adam_, kAdamPrefix);
}

void MuonWithAdam::apply_state(const StateFile& file) {
  muon_.apply_state(unprefixed(file, kMuonPrefix));
  adam_.apply_state(unprefixed(file, kAdamPrefix));
}

std::unique_ptr<Optimizer> make_muon_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                               std::span<const TensorView> grads) {
  return std::make_unique<MuonWithAdam>(o, params, grads);
}

}  // namespace gradkit::train
