#include "gradkit/optim/mixed_precision.h"

#include <string>

#include "gradkit/core/error.h"
#include "gradkit/ops/master.h"
#include "gradkit/optim/state_file.h"
#include "optim/moment_storage.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "MixedPrecision";

// The device scalars one step passes between its kernels.
struct Scalars {
  float grad_divisor;
  float global_norm;
  bool found_inf;
};

template <class Optimizer> constexpr std::string_view kind();
template <> constexpr std::string_view kind<Adam>() { return "mixed_precision_adam"; }
template <> constexpr std::string_view kind<Lamb>() { return "mixed_precision_lamb"; }

// The optimizer's update with the check's results: the gradient divisor
// (loss scale and clipping) and the found-inf flag, both on the device.
void optimizer_step(Adam& adam, Stream stream, const bool* found_inf, const float* grad_divisor) {
  adam.step(stream, found_inf, grad_divisor);
}
void optimizer_step(Lamb& lamb, Stream stream, const bool* found_inf, const float* grad_divisor) {
  // The global clipping is in the divisor; LAMB's own clipping gets no norm.
  LambStep inputs;
  inputs.loss_scale_device = grad_divisor;
  inputs.found_inf = found_inf;
  lamb.step(stream, inputs);
}

}  // namespace

template <class Optimizer>
MixedPrecision<Optimizer>::MixedPrecision(std::vector<Group> groups, MixedPrecisionOptions options,
                                          Options optimizer_options) {
  if (groups.empty()) throw_argument_error(ErrorCode::invalid_argument, kOp, "groups", "is empty; expected at least one group");
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string name = "groups[" + std::to_string(g) + "]";
    if (!groups[g].model_copy.empty()) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, name + ".model_copy",
                           "is given; expected none (the params are the model's weights, which the step writes)");
    }
    for (size_t i = 0; i < groups[g].params.size(); ++i) {
      const DType d = groups[g].params[i].dtype;
      if (d != DType::f16 && d != DType::bf16) {
        throw_argument_error(ErrorCode::dtype_unsupported, kOp, name + ".params[" + std::to_string(i) + "]",
                             "has dtype " + std::string(dtype_name(d)) + ", expected f16 or bf16 (the model's weights)");
      }
    }
  }
  check_master_storage(kOp, options.master, groups);
  const ParameterLists lists = flatten_groups(kOp, groups);
  const Device device = lists.device;
  masters_ = MasterStore(options.master, lists.params);

  scalars_ = Buffer(device, sizeof(Scalars));
  GradientCheckOptions check_options;
  check_options.norm = options.norm;
  check_options.max_norm = options.max_norm;
  check_ = GradientCheckPlan(lists.grads, check_options);
  scaler_ = LossScaler(device, options.scaler);

  size_t at = 0;
  for (Group& group : groups) {
    const size_t count = group.params.size();
    group.params.clear();  // the model's weights: now given as the store says
    masters_.append_to(group, at, count);
    at += count;
  }
  optimizer_ = std::make_unique<Optimizer>(std::move(groups), optimizer_options);
}

template <class Optimizer>
MixedPrecision<Optimizer>::~MixedPrecision() = default;

template <class Optimizer>
const bool* MixedPrecision<Optimizer>::found_inf_device() const {
  return &static_cast<Scalars*>(scalars_.data())->found_inf;
}

template <class Optimizer>
void MixedPrecision<Optimizer>::step(Stream stream) {
  auto* s = static_cast<Scalars*>(scalars_.data());
  check_.check({&s->found_inf, &s->grad_divisor, &s->global_norm, nullptr}, 1.0f, scaler_.scale_device(), stream);
  optimizer_step(*optimizer_, stream, &s->found_inf, &s->grad_divisor);
  scaler_.update(&s->found_inf, stream);
}

template <class Optimizer>
bool MixedPrecision<Optimizer>::last_step_skipped() const {
  Scalars s{};
  copy_to_host(&s, scalars_.data(), sizeof s, scalars_.device());
  return s.found_inf;
}

template <class Optimizer>
float MixedPrecision<Optimizer>::last_grad_norm() const {
  Scalars s{};
  copy_to_host(&s, scalars_.data(), sizeof s, scalars_.device());
  return s.global_norm;
}

template <class Optimizer>
void MixedPrecision<Optimizer>::save(const std::string& path) const {
  save_state(*this, path, kind<Optimizer>());
}

template <class Optimizer>
void MixedPrecision<Optimizer>::load(const std::string& path) {
  load_state(*this, path, kind<Optimizer>());
}

template <class Optimizer>
void MixedPrecision<Optimizer>::save_to(StateFile& file) const {
  optimizer_->save_to(file);
  Buffer joined;
  const std::vector<TensorView> f32 = masters_.f32(joined, true);
  const StateSection masters[] = {{"masters", &f32}};
  add_sections(file, masters);
  file.add("scaler", scaler_section(scaler_));
}

template <class Optimizer>
void MixedPrecision<Optimizer>::check_state(const std::string& path, const StateFile& file) const {
  const std::vector<TensorView> shapes = masters_.file_shapes();
  const StateSection masters[] = {{"masters", &shapes}};
  check_sections(path, file, masters);
  read_scaler_section(path, file, scaler_);
  optimizer_->check_state(path, file);
}

template <class Optimizer>
void MixedPrecision<Optimizer>::apply_state(const StateFile& file) {
  optimizer_->apply_state(file);
  Buffer loaded;
  const std::vector<TensorView> f32 = masters_.f32(loaded, false);
  const StateSection masters[] = {{"masters", &f32}};
  apply_sections(file, masters);
  scaler_.set_state(read_scaler_section("", file, scaler_));
  masters_.masters_written(f32);
}

template class MixedPrecision<Adam>;
template class MixedPrecision<Lamb>;

}  // namespace gradkit
