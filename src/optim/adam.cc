#include "gradkit/optim/adam.h"

#include <cstring>
#include <string>

#include "spec/step_counter.h"
#include "gradkit/core/error.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/optim/state_file.h"
#include "optim/hyperparameter_io.h"
#include "optim/moment_storage.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "Adam";
constexpr std::string_view kKind = "adam";

}  // namespace

Adam::Adam(std::vector<AdamGroup> groups, AdamOptions options)
    : groups_(std::move(groups)), options_(options) {
  if (groups_.empty()) throw_argument_error(ErrorCode::invalid_argument, kOp, "groups", "is empty; expected at least one group");
  const DType md = options_.moment_dtype;
  if (md != DType::f32 && md != DType::bf16 && md != DType::u8) {
    throw_argument_error(ErrorCode::dtype_unsupported, kOp, "options.moment_dtype",
                         "is " + std::string(dtype_name(md)) + ", expected f32, bf16 or u8");
  }
  check_moment_bits(kOp, "options.moment_bits", options_.moment_bits, md);
  const ParameterLists lists = flatten_groups(kOp, groups_);
  device_ = lists.device;
  const DType moment = lists.params.empty() || lists.params[0].dtype != DType::f64 ? options_.moment_dtype : DType::f64;
  bool amsgrad = false;
  std::vector<AdamHyperparameters> hyper;
  for (const AdamGroup& g : groups_) {
    hyper.push_back(g.hyperparameters);
    amsgrad = amsgrad || g.hyperparameters.amsgrad;
  }
  const int moments = amsgrad ? 3 : 2;
  // Zero-filled 8-bit moments decode to zero whatever their codes: their
  // absmax is 0.
  // 4-bit codes: quant4_bytes(numel) bytes per tensor, laid out as moments of that many elements.
  const int32_t bits = moment == DType::u8 ? options_.moment_bits : 0;
  const std::vector<TensorView> shapes = bits == 4 ? packed_4bit(lists.params) : lists.params;
  state_ = allocate_moments(device_, shapes, moment, moments);
  std::vector<std::vector<TensorView>*> views = {&exp_avg_, &exp_avg_sq_, &max_exp_avg_sq_};
  for (int k = 0; k < moments; ++k) *views[k] = moment_views(state_, shapes, moment, moments, k);
  if (moment == DType::u8) {
    absmax_ = allocate_absmax(device_, lists.params, exp_avg_absmax_, exp_avg_sq_absmax_,
                              bits == 4 ? kQuant4Block : kQuantBlock);
  }

  counter_ = Buffer(device_, sizeof(int64_t));
  lrs_ = Buffer(device_, sizeof(float) * groups_.size());
  AdamTensors tensors{lists.params, lists.grads, exp_avg_, exp_avg_sq_, max_exp_avg_sq_, lists.copies, {}, {}, {}};
  tensors.exp_avg_absmax = exp_avg_absmax_;
  tensors.exp_avg_sq_absmax = exp_avg_sq_absmax_;
  const std::vector<TensorView> remainders = flatten_remainders(kOp, groups_);
  tensors.weight_remainder = remainders;
  if (bits == 4) tensors.moment_bits = 4;
  plan_ = AdamPlan(tensors, hyper, lists.group_of_tensor);
  upload_lrs();
}

std::vector<StateSection> Adam::sections() const {
  std::vector<StateSection> out = {
      {"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}, {"max_exp_avg_sq", &max_exp_avg_sq_}};
  if (!exp_avg_absmax_.empty()) {  // 8-bit moments (format version 2), 4-bit ones (version 4)
    out.push_back({"exp_avg_absmax", &exp_avg_absmax_});
    out.push_back({"exp_avg_sq_absmax", &exp_avg_sq_absmax_});
  }
  return out;
}

void Adam::upload_lrs() {
  std::vector<float> lrs;
  for (const AdamGroup& g : groups_) lrs.push_back(g.hyperparameters.lr);
  copy_from_host(lrs_.data(), device_, lrs.data(), lrs.size() * sizeof(float));
}

void Adam::step(Stream stream, const bool* found_inf, const float* grad_scale_device, float grad_scale) {
  AdamStepInputs in;
  in.step_device = step_count_device();
  in.lr_device = lr_device();
  in.grad_scale = grad_scale;
  in.grad_scale_device = grad_scale_device;
  in.found_inf = found_inf;
  plan_.validate_inputs(in);
  spec::increment_counter(device_, step_count_device(), found_inf, stream);
  plan_.step(in, stream);
}

int64_t Adam::step_count() const {
  int64_t step = 0;
  copy_to_host(&step, counter_.data(), sizeof step, device_);
  return step;
}

float Adam::lr(int group) const {
  check_group_index(kOp, group, groups_.size());
  float value = 0;
  copy_to_host(&value, lr_device() + group, sizeof value, device_);
  return value;
}

void Adam::set_lr(int group, float lr) {
  check_group_index(kOp, group, groups_.size());
  AdamHyperparameters h = groups_[group].hyperparameters;
  h.lr = lr;
  validate(h, kOp, "groups[" + std::to_string(group) + "]");
  groups_[group].hyperparameters.lr = lr;
  copy_from_host(lr_device() + group, device_, &lr, sizeof lr);
}

void Adam::save(const std::string& path) const { save_state(*this, path, kKind); }

void Adam::load(const std::string& path) { load_state(*this, path, kKind); }

void Adam::save_to(StateFile& file) const {
  synchronize(device_);
  add_sections(file, sections());
  SectionWriter meta;
  meta.put(step_count()).put(moment_code(exp_avg_.empty() ? options_.moment_dtype : exp_avg_[0].dtype, plan_.moment_bits()));
  file.add("meta", meta.take());
  std::vector<AdamHyperparameters> hyper;
  for (size_t g = 0; g < groups_.size(); ++g) {
    hyper.push_back(groups_[g].hyperparameters);
    hyper.back().lr = lr(static_cast<int>(g));
  }
  file.add("groups", write_groups(master_groups(groups_), hyper));
}

void Adam::check_state(const std::string& path, const StateFile& file) const {
  SectionReader meta(file.get("meta"), "meta");
  read_step_and_moment(meta, path, moment_code(exp_avg_.empty() ? options_.moment_dtype : exp_avg_[0].dtype, plan_.moment_bits()));
  if (!meta.done()) throw Error(ErrorCode::io_error, "state file '" + path + "' section 'meta' has trailing bytes");
  const std::vector<AdamHyperparameters> hyper = read_groups(kOp, path, file.get("groups"), master_groups(groups_));
  for (size_t g = 0; g < hyper.size(); ++g) {
    if (hyper[g].amsgrad && max_exp_avg_sq_.empty()) {
      throw Error(ErrorCode::io_error, "state file '" + path + "' uses amsgrad in group " + std::to_string(g) +
                                           ", but this optimizer was made without it");
    }
  }
  check_sections(path, file, sections());
}

void Adam::apply_state(const StateFile& file) {
  SectionReader meta(file.get("meta"), "meta");
  const auto step = meta.get<int64_t>();
  const std::vector<AdamHyperparameters> hyper = read_groups(kOp, "", file.get("groups"), master_groups(groups_));
  apply_sections(file, sections());
  copy_from_host(counter_.data(), device_, &step, sizeof step);
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].hyperparameters = hyper[g];
  plan_.set_hyperparameters(hyper);
  upload_lrs();
}

}  // namespace gradkit
