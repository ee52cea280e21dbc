#include "gradkit/optim/muon.h"

#include <string>

#include "gradkit/core/error.h"
#include "gradkit/ops/step_counter.h"
#include "gradkit/optim/state_file.h"
#include "optim/hyperparameter_io.h"
#include "optim/moment_storage.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = "Muon";
constexpr std::string_view kKind = "muon";

std::vector<MuonHyperparameters> hyperparameters_of(const std::vector<MuonGroup>& groups) {
  std::vector<MuonHyperparameters> out;
  for (const MuonGroup& g : groups) out.push_back(g.hyperparameters);
  return out;
}

}  // namespace

Muon::Muon(std::vector<MuonGroup> groups, MuonOptions options) : groups_(std::move(groups)), options_(options) {
  if (groups_.empty()) throw_argument_error(ErrorCode::invalid_argument, kOp, "groups", "is empty; expected at least one group");
  const DType md = options_.momentum_dtype;
  if (md != DType::f32 && md != DType::bf16) {
    throw_argument_error(ErrorCode::dtype_unsupported, kOp, "options.momentum_dtype",
                         "is " + std::string(dtype_name(md)) + ", expected f32 or bf16");
  }
  std::vector<MatrixShape> shapes;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const MuonGroup& group = groups_[g];
    const std::string name = "groups[" + std::to_string(g) + "]";
    if (!group.model_copy.empty()) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, name + ".model_copy",
                           "is given; expected none (Muon updates its parameters in place)");
    }
    if (group.shapes.size() != group.params.size()) {
      throw_argument_error(ErrorCode::size_mismatch, kOp, name + ".shapes",
                           "has " + std::to_string(group.shapes.size()) + " entries, expected " +
                               std::to_string(group.params.size()) + " (one per param)");
    }
    shapes.insert(shapes.end(), group.shapes.begin(), group.shapes.end());
  }
  const ParameterLists lists = flatten_groups(kOp, groups_);
  device_ = lists.device;
  state_ = allocate_moments(device_, lists.params, md, 1);
  momentum_ = moment_views(state_, lists.params, md, 1, 0);
  // NorMuon's second moments (f32, max(rows, cols) a matrix), for every
  // tensor, so that a schedule may turn second_moment on in any group.
  int64_t total = 0;
  for (const MatrixShape& s : shapes) total += muon_second_moment_numel(s);
  second_state_ = Buffer(device_, static_cast<size_t>(total) * sizeof(float));
  int64_t at = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t n = muon_second_moment_numel(shapes[i]);
    second_moment_.push_back(TensorView{static_cast<float*>(second_state_.data()) + at, n, DType::f32, device_});
    at += n;
  }
  plan_ = MuonPlan(MuonTensors{lists.params, lists.grads, momentum_, shapes, second_moment_}, hyperparameters_of(groups_),
                   lists.group_of_tensor, options_.plan);
  counter_ = Buffer(device_, sizeof(int64_t));  // zero-filled: no step completed
}

void Muon::step(Stream stream, const MuonStep& s) {
  MuonStepInputs in;
  in.found_inf = s.found_inf;
  in.grad_scale = s.grad_scale;
  in.grad_scale_device = s.grad_scale_device;
  plan_.validate_inputs(in);  // before the count moves
  advance_step(static_cast<int64_t*>(counter_.data()), device_, s.found_inf, stream);
  plan_.step(in, stream);
}

int64_t Muon::step_count() const {
  int64_t completed = 0;
  copy_to_host(&completed, counter_.data(), sizeof completed, device_);
  return completed;
}

void Muon::set_hyperparameters(int group, const MuonHyperparameters& h) {
  check_group_index(kOp, group, groups_.size());
  std::vector<MuonHyperparameters> all = hyperparameters_of(groups_);
  all[static_cast<size_t>(group)] = h;
  plan_.set_hyperparameters(all);  // validates; nothing changes if it throws
  groups_[static_cast<size_t>(group)].hyperparameters = h;
}

const MuonHyperparameters& Muon::hyperparameters(int group) const {
  check_group_index(kOp, group, groups_.size());
  return groups_[static_cast<size_t>(group)].hyperparameters;
}

void Muon::save(const std::string& path) const { save_state(*this, path, kKind); }

void Muon::load(const std::string& path) { load_state(*this, path, kKind); }

std::vector<StateSection> Muon::sections() const { return {{"momentum_buffer", &momentum_}}; }

// Sections a file written without the recipe lacks; read where present
// (otherwise the recipe's defaults and a zero second moment).
std::vector<StateSection> Muon::recipe_sections() const { return {{"second_moment", &second_moment_}}; }

std::vector<uint8_t> Muon::recipe_section() const {
  SectionWriter out;
  for (const MuonGroup& g : groups_) write_muon_recipe(out, g.hyperparameters);
  return out.take();
}

// The groups' hyperparameters from `groups` and, where the file has one,
// `recipe`; each entry validated. Throws io_error naming the file.
std::vector<MuonHyperparameters> Muon::read_hyperparameters_of(const std::string& path, const StateFile& file) const {
  std::vector<MuonHyperparameters> hyper = read_groups(kOp, path, file.get("groups"), groups_);
  if (!file.has("recipe")) return hyper;
  try {
    SectionReader in(file.get("recipe"), "recipe");
    for (size_t g = 0; g < hyper.size(); ++g) {
      read_muon_recipe(in, hyper[g]);
      validate(hyper[g], kOp, "groups[" + std::to_string(g) + "]");
    }
    if (!in.done()) throw Error(ErrorCode::io_error, "section 'recipe' has trailing bytes");
  } catch (const Error& e) {
    throw Error(ErrorCode::io_error, "state file '" + path + "' has a bad Muon recipe: " + e.what());
  }
  return hyper;
}

// Every tensor's (batch, rows, cols): a file whose matrices have other
// shapes, the same element counts though, is not this optimizer's.
std::vector<uint8_t> Muon::shapes_section() const {
  SectionWriter out;
  for (const MuonGroup& g : groups_)
    for (const MatrixShape& s : g.shapes) out.put(s.batch).put(s.rows).put(s.cols);
  return out.take();
}

void Muon::save_to(StateFile& file) const {
  synchronize(device_);
  add_sections(file, sections());
  add_sections(file, recipe_sections());
  file.add("recipe", recipe_section());
  SectionWriter meta;
  meta.put(step_count()).put(static_cast<uint32_t>(options_.momentum_dtype));
  file.add("meta", meta.take());
  file.add("groups", write_groups(groups_, hyperparameters_of(groups_)));
  file.add("shapes", shapes_section());
}

void Muon::check_state(const std::string& path, const StateFile& file) const {
  SectionReader meta(file.get("meta"), "meta");
  read_step_and_moment(meta, path, options_.momentum_dtype);
  if (!meta.done()) throw Error(ErrorCode::io_error, "state file '" + path + "' section 'meta' has trailing bytes");
  read_hyperparameters_of(path, file);
  if (file.get("shapes") != shapes_section()) {
    throw Error(ErrorCode::io_error, "state file '" + path +
                                         "' does not match this optimizer: its matrices have other shapes (section "
                                         "'shapes')");
  }
  check_sections(path, file, sections());
  if (file.has("second_moment")) check_sections(path, file, recipe_sections());
}

void Muon::apply_state(const StateFile& file) {
  SectionReader meta(file.get("meta"), "meta");
  const auto completed = meta.get<int64_t>();
  const std::vector<MuonHyperparameters> hyper = read_hyperparameters_of("", file);
  plan_.set_hyperparameters(hyper);
  apply_sections(file, sections());
  if (file.has("second_moment")) {
    apply_sections(file, recipe_sections());
  } else {
    const std::vector<float> zeros(static_cast<size_t>(second_state_.bytes() / sizeof(float)), 0.0f);
    copy_from_host(second_state_.data(), device_, zeros.data(), second_state_.bytes());
  }
  copy_from_host(counter_.data(), device_, &completed, sizeof completed);
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].hyperparameters = hyper[g];
}

}  // namespace gradkit
