// Parameter groups in a state file: each group's hyperparameters, tensor
// count, and every tensor's element count and dtype, so that loading into an
// optimizer of another shape is refused before anything is written.
#pragma once

#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/lamb.h"
#include "gradkit/optim/state_file.h"

namespace gradkit {

void write_hyperparameters(SectionWriter& out, const AdamHyperparameters& h);
AdamHyperparameters read_hyperparameters(SectionReader& in, const AdamHyperparameters* /*tag*/);
void write_hyperparameters(SectionWriter& out, const LambHyperparameters& h);
LambHyperparameters read_hyperparameters(SectionReader& in, const LambHyperparameters* /*tag*/);

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

// Reads the groups back and checks them against `groups`; returns the
// hyperparameters. Throws io_error naming the file and what differs.
template <class Group, class Hyper = decltype(Group{}.hyperparameters)>
std::vector<Hyper> read_groups(const std::string& path, const std::vector<uint8_t>& bytes,
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
    const auto tensors = in.get<uint32_t>();
    if (tensors != groups[g].params.size()) {
      mismatch("group " + std::to_string(g) + " has " + std::to_string(tensors) + " tensors, expected " +
               std::to_string(groups[g].params.size()));
    }
    for (size_t i = 0; i < tensors; ++i) {
      const auto numel = in.get<int64_t>();
      const auto dtype = static_cast<DType>(in.get<uint32_t>());
      const TensorView& p = groups[g].params[i];
      if (numel != p.numel || dtype != p.dtype) {
        mismatch("groups[" + std::to_string(g) + "] tensor " + std::to_string(i) + " is " + std::to_string(numel) +
                 " elements of " + std::string(dtype_name(dtype)) + ", expected " + std::to_string(p.numel) +
                 " of " + std::string(dtype_name(p.dtype)));
      }
    }
  }
  if (!in.done()) mismatch("section 'groups' has trailing bytes");
  return hyper;
}

}  // namespace gradkit
