// What every owning optimizer does with its parameter groups and its state:
// flatten the groups into plan lists, allocate the moments, move them to and
// from a state file.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/optim/loss_scaler.h"
#include "gradkit/optim/state_file.h"

namespace gradkit {

struct ParameterLists {
  Device device = Device::cpu();
  std::vector<TensorView> params, grads, copies;
  std::vector<int32_t> group_of_tensor;
};

// Concatenates the groups' lists. Each group needs as many grads as params;
// model copies are given for every param or for none.
template <class Group>
ParameterLists flatten_groups(std::string_view op, const std::vector<Group>& groups) {
  ParameterLists out;
  // Model copies are used when any group gives them; then every group gives
  // one per param (a group without params, none).
  bool copies = false;
  for (const Group& group : groups) copies = copies || !group.model_copy.empty();
  for (size_t g = 0; g < groups.size(); ++g) {
    const Group& group = groups[g];
    const std::string name = "groups[" + std::to_string(g) + "]";
    if (group.grads.size() != group.params.size()) {
      throw_argument_error(ErrorCode::size_mismatch, op, name + ".grads",
                           "has " + std::to_string(group.grads.size()) + " tensors, expected " +
                               std::to_string(group.params.size()) + " (one per param)");
    }
    const size_t expected_copies = copies ? group.params.size() : 0;
    if (group.model_copy.size() != expected_copies) {
      throw_argument_error(ErrorCode::size_mismatch, op, name + ".model_copy",
                           "has " + std::to_string(group.model_copy.size()) + " tensors, expected " +
                               std::to_string(expected_copies) +
                               (copies ? " (one per param: another group gives model copies)"
                                       : " (no group gives model copies)"));
    }
    out.params.insert(out.params.end(), group.params.begin(), group.params.end());
    out.grads.insert(out.grads.end(), group.grads.begin(), group.grads.end());
    out.copies.insert(out.copies.end(), group.model_copy.begin(), group.model_copy.end());
    out.group_of_tensor.insert(out.group_of_tensor.end(), group.params.size(), static_cast<int32_t>(g));
  }
  if (!out.params.empty()) out.device = out.params[0].device;
  return out;
}

// The groups' weight remainders, concatenated like flatten_groups' params:
// given for every param or for none (a group without params, none).
template <class Group>
std::vector<TensorView> flatten_remainders(std::string_view op, const std::vector<Group>& groups) {
  std::vector<TensorView> out;
  bool any = false;
  for (const Group& g : groups) any = any || !g.weight_remainder.empty();
  for (size_t g = 0; g < groups.size() && any; ++g) {
    const Group& group = groups[g];
    if (group.weight_remainder.size() != group.params.size()) {
      throw_argument_error(ErrorCode::size_mismatch, op, "groups[" + std::to_string(g) + "].weight_remainder",
                           "has " + std::to_string(group.weight_remainder.size()) + " tensors, expected " +
                               std::to_string(group.params.size()) + " (one per param: another group gives them)");
    }
    out.insert(out.end(), group.weight_remainder.begin(), group.weight_remainder.end());
  }
  return out;
}

// The groups as a state file records them: each tensor with the dtype of the
// master the step updates (f32 for bf16 weights with a remainder), so that a
// file loads whichever way the masters are kept.
template <class Group>
std::vector<Group> master_groups(const std::vector<Group>& groups) {
  std::vector<Group> out = groups;
  for (Group& g : out) {
    if (g.weight_remainder.empty()) continue;
    for (TensorView& p : g.params) p.dtype = DType::f32;
  }
  return out;
}

// `count` moment tensors per param, each shaped like its param, with dtype
// `dtype`, zero-filled, back to back at 256-byte boundaries in one buffer.
Buffer allocate_moments(Device device, const std::vector<TensorView>& params, DType dtype, int count);
// The same layout in pinned host memory (Buffer::pinned), for tensors that
// are copied to and from a GPU asynchronously.
Buffer allocate_pinned_moments(const std::vector<TensorView>& params, DType dtype, int count);
// The views of moment k (0 <= k < count) into that buffer.
std::vector<TensorView> moment_views(const Buffer& buffer, const std::vector<TensorView>& params, DType dtype,
                                     int count, int k);

// The absmax lists of 8-bit moments (gradkit/ops/low_bit.h): for each
// param, quant_blocks(numel) f32 values for exp_avg and as many for
// exp_avg_sq, zero-filled (zero-filled codes then decode to 0), in one buffer.
// `block`: kQuantBlock, or kQuant4Block for 4-bit moments.
Buffer allocate_absmax(Device device, const std::vector<TensorView>& params, std::vector<TensorView>& exp_avg_absmax,
                       std::vector<TensorView>& exp_avg_sq_absmax, int32_t block = kQuantBlock);
// params with each element count replaced by its 4-bit codes' bytes
// (quant4_bytes): the shapes allocate_moments lays 4-bit moments out by.
std::vector<TensorView> packed_4bit(std::vector<TensorView> params);
// Throws naming `arg` unless bits is 8, or 4 with u8 moments.
void check_moment_bits(std::string_view op, std::string_view arg, int32_t bits, DType moment);
// An optimizer's (Adam's, Lamb's) moments' bits as their lists are cut into
// shards and pieces: 4, or 8 (also for float moments, whose lists are per
// element, and without absmax lists).
template <class Optimizer>
int32_t cut_bits(const Optimizer& o) {
  return o.moment_bits() == 4 ? 4 : 8;
}

// The bytes of a list of tensors, concatenated, and back.
std::vector<uint8_t> download(const std::vector<TensorView>& tensors);
void upload(const std::vector<uint8_t>& bytes, const std::vector<TensorView>& tensors);
// Throws io_error unless section `name` holds exactly the bytes of `tensors`.
void check_section_size(const std::string& path, const StateFile& file, std::string_view name,
                        const std::vector<TensorView>& tensors);

void check_group_index(std::string_view op, int group, size_t num_groups);

// A named list of state tensors in a state file.
struct StateSection {
  std::string_view name;
  const std::vector<TensorView>* tensors;
};

// Reads a state file and checks that it holds state of `kind`.
StateFile read_state(const std::string& path, std::string_view kind);

// An owning optimizer's save(path) and load(path): its save_to's sections
// behind a `kind` section, written atomically; read, checked whole
// (check_state) before anything is applied (apply_state).
template <class Optimizer>
void save_state(Optimizer& optimizer, const std::string& path, std::string_view kind) {
  StateFile file;
  file.add("kind", std::vector<uint8_t>(kind.begin(), kind.end()));
  optimizer.save_to(file);
  file.write(path);
}
template <class Optimizer>
void load_state(Optimizer& optimizer, const std::string& path, std::string_view kind) {
  const StateFile file = read_state(path, kind);
  optimizer.check_state(path, file);
  optimizer.apply_state(file);
}
// Adds one section per list of tensors, with their bytes.
void add_sections(StateFile& file, std::span<const StateSection> sections);
// Throws io_error unless every section holds exactly its tensors' bytes.
void check_sections(const std::string& path, const StateFile& file, std::span<const StateSection> sections);
// Copies the sections into the tensors (after check_sections).
void apply_sections(const StateFile& file, std::span<const StateSection> sections);

// The mixed-precision wrappers' shared pieces: the master weights cast
// from the model's weights (or back), waited for; and the loss scaler's
// state as a state file's 'scaler' section and back (reading throws
// io_error naming the file unless the scaler accepts the state).
void cast_into(const std::vector<TensorView>& to, const std::vector<TensorView>& from);
std::vector<uint8_t> scaler_section(const LossScaler& scaler);
LossScalerState read_scaler_section(const std::string& path, const StateFile& file, const LossScaler& scaler);

}  // namespace gradkit
