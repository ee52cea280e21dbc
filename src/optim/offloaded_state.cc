// Offloaded<Adam or Lamb>'s state file: the non-offloaded optimizer's
// format, so that a checkpoint moves between the two (docs/state-format.md).
#include <string>

#include "gradkit/core/error.h"
#include "gradkit/optim/state_file.h"
#include "optim/hyperparameter_io.h"
#include "optim/moment_storage.h"
#include "optim/offloaded_parts.h"

namespace gradkit {
namespace {

// f32 weights: the optimizer's file; f16/bf16 weights: MixedPrecision's (it
// adds the masters, which the model's weights cannot give back).
template <class Optimizer>
std::string_view kind(bool low_precision) {
  return low_precision ? OffloadTraits<Optimizer>::mixed_kind : OffloadTraits<Optimizer>::kind;
}

}  // namespace

template <class Optimizer>
void Offloaded<Optimizer>::save(const std::string& path) {
  save_state(*this, path, kind<Optimizer>(low_precision_));
}

template <class Optimizer>
void Offloaded<Optimizer>::load(const std::string& path) {
  load_state(*this, path, kind<Optimizer>(low_precision_));
}

template <class Optimizer>
void Offloaded<Optimizer>::save_to(StateFile& file) {
  synchronize();
  optimizer_->save_to(file);
  if (low_precision_) {
    const StateSection masters[] = {{"masters", &masters_}};
    add_sections(file, masters);
  }
  if (scaler_) {
    file.add("scaler", scaler_section(*scaler_));
  } else if (low_precision_) {
    // MixedPrecision's file has a scaler: a scale of 1 that nothing
    // has changed stands for none (ignored when loaded here).
    SectionWriter none;
    none.put(LossScalerState{1.0f, 0, 1});
    file.add("scaler", none.take());
  }
}

template <class Optimizer>
void Offloaded<Optimizer>::check_state(const std::string& path, const StateFile& file) const {
  optimizer_->check_state(path, file);
  if (low_precision_) {
    const StateSection masters[] = {{"masters", &masters_}};
    check_sections(path, file, masters);
  }
  if (scaler_ && file.has("scaler")) read_scaler_section(path, file, *scaler_);
  (void)read_groups(OffloadTraits<Optimizer>::op, path, file.get("groups"), groups_);
}

template <class Optimizer>
void Offloaded<Optimizer>::apply_state(const StateFile& file) {
  synchronize();
  const auto hyper = read_groups(OffloadTraits<Optimizer>::op, "", file.get("groups"), groups_);
  optimizer_->apply_state(file);
  for (Piece& p : pieces_) p.plan.set_hyperparameters(hyper);
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].hyperparameters = hyper[g];
  if (scaler_ && file.has("scaler")) scaler_->set_state(read_scaler_section("", file, *scaler_));
  if (low_precision_) {
    const StateSection masters[] = {{"masters", &masters_}};
    apply_sections(file, masters);
    cast_into(staged_copies_, masters_);
    copy_weights_to_device();
  } else {
    refresh_masters();  // the model's weights are the masters: loaded with the model
  }
}

// Both copies wait for the device once, queue every tensor's copy on a lane
// (pinned memory: asynchronous) and wait for the lane once, where a
// synchronous copy per tensor waited for the whole device before each of
// hundreds of tensors.
template <class Optimizer>
void Offloaded<Optimizer>::refresh_masters() {
  if (worker_) synchronize();  // the constructor calls it before the worker exists
  const std::vector<TensorView>& into = low_precision_ ? staged_copies_ : masters_;
  gradkit::synchronize(device_);  // the weights as every stream left them
  for (size_t i = 0; i < params_.size(); ++i) {
    lanes_->copy(detail::OffloadLanes::to_host, into[i].data, params_[i].data, params_[i].bytes());
  }
  lanes_->synchronize();
  if (low_precision_) cast_into(masters_, staged_copies_);
}

template <class Optimizer>
void Offloaded<Optimizer>::copy_weights_to_device() {
  const std::vector<TensorView>& from = low_precision_ ? staged_copies_ : masters_;
  gradkit::synchronize(device_);  // no stream still reads the weights
  for (size_t i = 0; i < params_.size(); ++i) {
    lanes_->copy(detail::OffloadLanes::to_device, params_[i].data, from[i].data, params_[i].bytes());
  }
  lanes_->synchronize();
}

// This file's members of both (offloaded.cc instantiates the class).
template void Offloaded<Adam>::save(const std::string&);
template void Offloaded<Lamb>::save(const std::string&);
template void Offloaded<Adam>::load(const std::string&);
template void Offloaded<Lamb>::load(const std::string&);
template void Offloaded<Adam>::save_to(StateFile&);
template void Offloaded<Lamb>::save_to(StateFile&);
template void Offloaded<Adam>::check_state(const std::string&, const StateFile&) const;
template void Offloaded<Lamb>::check_state(const std::string&, const StateFile&) const;
template void Offloaded<Adam>::apply_state(const StateFile&);
template void Offloaded<Lamb>::apply_state(const StateFile&);
template void Offloaded<Adam>::refresh_masters();
template void Offloaded<Lamb>::refresh_masters();

}  // namespace gradkit
