// --optimizer muon: gradkit::Muon for the MLP's weight matrices but the
// output layer's, gradkit::Adam for the rest (the output layer, the biases),
// the split the Muon papers make of a model (and gradkit.torch's
// muon_param_groups: the 2-D weights but the head's). Muon's learning rate
// is adjusted to match AdamW's update RMS (MuonLrAdjust::match_rms_adamw,
// Moonshot's "Muon is Scalable"), so one --lr and --weight-decay serve both.
#pragma once

#include <span>
#include <string>

#include "gradkit/optim/adam.h"
#include "gradkit/optim/muon.h"
#include "train/backend.h"

namespace gradkit::train {

class MuonWithAdam final : public Optimizer {
 public:
  // `params` and `grads` in the MLP's order (W1, b1, W2, b2, ...), f32.
  MuonWithAdam(const TrainOptions& o, std::span<const TensorView> params, std::span<const TensorView> grads);

  void step() override;
  void set_lr(float lr) override;
  // Each optimizer's sections under its own prefix ("muon.", "adam."), as
  // each writes them into a file of its own.
  void save_to(StateFile& file) override;
  void check_state(const std::string& path, const StateFile& file) const override;
  void apply_state(const StateFile& file) override;

 private:
  Muon muon_;
  Adam adam_;
};

}  // namespace gradkit::train
