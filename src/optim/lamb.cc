#include "gradkit/optim/lamb.h"

#include <string>

#include "gradkit/core/error.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/optim/state_file.h"
#include "optim/hyperparameter_io.h"
#include "optim/moment_storage.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "Lamb";
constexpr std::string_view kKind = "lamb";

}  // namespace

Lamb::Lamb(std::vector<LambGroup> groups, LambOptions options) : groups_(std::move(groups)), options_(options) {
  if (groups_.empty()) throw_argument_error(ErrorCode::invalid_argument, kOp, "groups", "is empty; expected at least one group");
  const DType md = options_.moment_dtype;
  if (md != DType::f32 && md != DType::bf16 && md != DType::u8) {
    throw_argument_error(ErrorCode::dtype_unsupported, kOp, "options.moment_dtype",
                         "is " + std::string(dtype_name(md)) + ", expected f32, bf16 or u8");
  }
  check_moment_bits(kOp, "options.moment_bits", options_.moment_bits, md);
  validate_eta(options_.eta, kOp, "options.eta");
  const ParameterLists lists = flatten_groups(kOp, groups_);
  const std::vector<TensorView> remainders = flatten_remainders(kOp, groups_);
  if (!remainders.empty() && md == DType::u8) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "options.moment_dtype",
                         "is u8 with weight_remainder; expected f32 or bf16 (LAMB's remainder master takes float "
                         "moments only)");
  }
  device_ = lists.device;
  const DType moment = lists.params.empty() || lists.params[0].dtype != DType::f64 ? options_.moment_dtype : DType::f64;
  // 4-bit codes: quant4_bytes(numel) bytes per tensor, laid out as moments of that many elements.
  const int32_t bits = moment == DType::u8 ? options_.moment_bits : 8;
  const std::vector<TensorView> shapes = bits == 4 ? packed_4bit(lists.params) : lists.params;
  state_ = allocate_moments(device_, shapes, moment, 2);
  exp_avg_ = moment_views(state_, shapes, moment, 2, 0);
  exp_avg_sq_ = moment_views(state_, shapes, moment, 2, 1);
  if (moment == DType::u8) {
    absmax_ = allocate_absmax(device_, lists.params, exp_avg_absmax_, exp_avg_sq_absmax_, quant_block_of(bits));
  }
  std::vector<LambHyperparameters> hyper;
  for (const LambGroup& g : groups_) hyper.push_back(g.hyperparameters);
  plan_ = LambPlan(LambTensors{lists.params, lists.grads, exp_avg_, exp_avg_sq_, lists.copies, {}, exp_avg_absmax_,
                               exp_avg_sq_absmax_, remainders, bits},
                   hyper, lists.group_of_tensor);
  counter_ = Buffer(device_, sizeof(int64_t));
  const int64_t first = 1;
  copy_from_host(counter_.data(), device_, &first, sizeof first);
  eta_ = Buffer(device_, sizeof(float));
  set_eta(options_.eta);
}

void Lamb::step(Stream stream, const LambStep& s) {
  LambStepInputs in;
  in.eta_device = eta_device();
  in.loss_scale = s.loss_scale;
  in.loss_scale_device = s.loss_scale_device;
  in.gradient_norm = s.gradient_norm;
  in.gradient_norm_device = s.gradient_norm_device;
  in.step_device = next_step_device();
  in.found_inf = s.found_inf;
  in.split = s.split;
  plan_.step(in, stream);
}

int64_t Lamb::step_count() const {
  int64_t next = 0;
  copy_to_host(&next, counter_.data(), sizeof next, device_);
  return next - 1;
}

float Lamb::eta() const {
  float value = 0;
  copy_to_host(&value, eta_.data(), sizeof value, device_);
  return value;
}

void Lamb::set_eta(float eta) {
  validate_eta(eta, kOp, "eta");
  options_.eta = eta;
  copy_from_host(eta_.data(), device_, &eta, sizeof eta);
}

DType Lamb::stored_moment_dtype() const { return exp_avg_.empty() ? options_.moment_dtype : exp_avg_[0].dtype; }

void Lamb::save(const std::string& path) const { save_state(*this, path, kKind); }

void Lamb::load(const std::string& path) { load_state(*this, path, kKind); }

std::vector<StateSection> Lamb::sections() const {
  std::vector<StateSection> out = {{"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}};
  if (!exp_avg_absmax_.empty()) {  // 8-bit moments (format version 2), 4-bit ones (version 4)
    out.push_back({"exp_avg_absmax", &exp_avg_absmax_});
    out.push_back({"exp_avg_sq_absmax", &exp_avg_sq_absmax_});
  }
  return out;
}

void Lamb::save_to(StateFile& file) const {
  synchronize(device_);
  add_sections(file, sections());
  SectionWriter meta;
  meta.put(step_count()).put(moment_code(stored_moment_dtype(), plan_.moment_bits())).put(eta());
  file.add("meta", meta.take());
  std::vector<LambHyperparameters> hyper;
  for (const LambGroup& g : groups_) hyper.push_back(g.hyperparameters);
  file.add("groups", write_groups(master_groups(groups_), hyper));
}

void Lamb::check_state(const std::string& path, const StateFile& file) const {
  SectionReader meta(file.get("meta"), "meta");
  read_step_and_moment(meta, path, moment_code(stored_moment_dtype(), plan_.moment_bits()));
  const auto eta = meta.get<float>();
  try {
    validate_eta(eta, kOp, "eta");
  } catch (const Error& e) {
    throw Error(ErrorCode::io_error, "state file '" + path + "' section 'meta' has a bad eta: " + e.what());
  }
  if (!meta.done()) throw Error(ErrorCode::io_error, "state file '" + path + "' section 'meta' has trailing bytes");
  read_groups(kOp, path, file.get("groups"), master_groups(groups_));
  check_sections(path, file, sections());
}

void Lamb::apply_state(const StateFile& file) {
  SectionReader meta(file.get("meta"), "meta");
  const auto completed = meta.get<int64_t>();
  meta.get<uint32_t>();
  const auto eta = meta.get<float>();
  const std::vector<LambHyperparameters> hyper = read_groups(kOp, "", file.get("groups"), master_groups(groups_));
  apply_sections(file, sections());
  const int64_t next = completed + 1;
  copy_from_host(counter_.data(), device_, &next, sizeof next);
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].hyperparameters = hyper[g];
  plan_.set_hyperparameters(hyper);
  set_eta(eta);
}

}  // namespace gradkit
