// Parameter groups in a state file: each group's hyperparameters, tensor
// count, and every tensor's element count and dtype, so that loading into an
// optimizer of another shape is refused before anything is written.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/lamb.h"
#include "gradkit/ops/muon.h"
#include "gradkit/optim/state_file.h"

namespace gradkit {

void write_hyperparameters(SectionWriter& out, const AdamHyperparameters& h);
AdamHyperparameters read_hyperparameters(SectionReader& in, const AdamHyperparameters* /*tag*/);
void write_hyperparameters(SectionWriter& out, const LambHyperparameters& h);
LambHyperparameters read_hyperparameters(SectionReader& in, const LambHyperparameters* /*tag*/);
void write_hyperparameters(SectionWriter& out, const MuonHyperparameters& h);
MuonHyperparameters read_hyperparameters(SectionReader& in, const MuonHyperparameters* /*tag*/);

// A dtype as a state file stores it (u32): its name, or "unknown dtype code
// N" for a code that is no dtype (a cast to DType would keep its low byte).
std::string dtype_code_name(uint32_t code);

// The head of an optimizer's 'meta' section: i64 step count (steps
// completed), u32 moment dtype. Throws io_error naming the file and the
// field unless the count is one the next step can increment (0 to
// 2^63 - 2) and the dtype is `moment`; returns the count.
int64_t read_step_and_moment(SectionReader& meta, const std::string& path, DType moment);
// The same against a moment code (moment_code).
int64_t read_step_and_moment(SectionReader& meta, const std::string& path, uint32_t moment);
// The u32 a state file's meta gives the moments (docs/state-format.md): the
// dtype's code, or kFourBitMomentCode for 4-bit moments (u8 with 4 bits).
// Format version 3's 4-bit moments (code 5) kept the second moment on the
// linear map; their codes mean other values, so no reader takes them.
inline constexpr uint32_t kLinearFourBitMomentCode = 5;
inline constexpr uint32_t kFourBitMomentCode = 6;
inline uint32_t moment_code(DType moment, int32_t bits) {
  return moment == DType::u8 && bits == 4 ? kFourBitMomentCode : static_cast<uint32_t>(moment);
}

// Muon's recipe (docs/state-format.md, section `recipe`): per group, the
// Newton-Schulz triples and the recipe's parts that `groups` does not hold.
void write_muon_recipe(SectionWriter& out, const MuonHyperparameters& h);
// Reads one group's into `h` (its other fields kept). Throws io_error on a
// bad triple count; the caller validates the whole entry.
void read_muon_recipe(SectionReader& in, MuonHyperparameters& h);

template <class Group, class Hyper>
std::vector<uint8_t> write_groups(const std::vector<Group>& groups, const std::vector<Hyper>& hyper) {
  SectionWriter out;
  out.put(static_cast<uint32_t>(groups.size()));
  for (size_t g = 0; g < groups.size(); ++g) {
    write_hyperparameters(out, hyper[g]);
    out.put(static_cast<uint32_t>(groups[g].params.size()));
    for (const TensorView& p : groups[g].params) out.put(p.numel).put(static_cast<uint32_t>(p.dtype));
  }
  return out.take();
}

// Reads the groups back and checks them against `groups` and each group's
// hyperparameters with validate(); returns the hyperparameters. Throws
// io_error naming the file and what differs or is out of range (with `op`,
// the reading optimizer, before the argument a bad hyperparameter is).
template <class Group, class Hyper = decltype(Group{}.hyperparameters)>
std::vector<Hyper> read_groups(std::string_view op, const std::string& path, const std::vector<uint8_t>& bytes,
                               const std::vector<Group>& groups) {
  auto mismatch = [&](const std::string& what) {
    throw Error(ErrorCode::io_error, "state file '" + path + "' does not match this optimizer: " + what);
  };
  SectionReader in(bytes, "groups");
  const auto count = in.get<uint32_t>();
  if (count != groups.size()) {
    mismatch("it has " + std::to_string(count) + " groups, expected " + std::to_string(groups.size()));
  }
  std::vector<Hyper> hyper;
  for (size_t g = 0; g < groups.size(); ++g) {
    hyper.push_back(read_hyperparameters(in, static_cast<const Hyper*>(nullptr)));
    try {
      validate(hyper.back(), op, "groups[" + std::to_string(g) + "]");
    } catch (const Error& e) {
      throw Error(ErrorCode::io_error, "state file '" + path + "' has bad hyperparameters: " + e.what());
    }
    const auto tensors = in.get<uint32_t>();
    if (tensors != groups[g].params.size()) {
      mismatch("group " + std::to_string(g) + " has " + std::to_string(tensors) + " tensors, expected " +
               std::to_string(groups[g].params.size()));
    }
    for (size_t i = 0; i < tensors; ++i) {
      const auto numel = in.get<int64_t>();
      const auto dtype = in.get<uint32_t>();
      const TensorView& p = groups[g].params[i];
      if (numel != p.numel || dtype != static_cast<uint32_t>(p.dtype)) {
        mismatch("groups[" + std::to_string(g) + "] tensor " + std::to_string(i) + " is " + std::to_string(numel) +
                 " elements of " + dtype_code_name(dtype) + ", expected " + std::to_string(p.numel) + " of " +
                 std::string(dtype_name(p.dtype)));
      }
    }
  }
  if (!in.done()) mismatch("section 'groups' has trailing bytes");
  return hyper;
}

}  // namespace gradkit
