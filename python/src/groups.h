// What the owning optimizers' bindings share: parameter groups given from
// Python as dicts, and an owning C++ object kept with the arrays it points into.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "gradkit/core/error.h"
#include "tensors.h"

namespace gradkit::python {

using Arrays = std::vector<Array>;

// A group given from Python as a dict: {"params": [...], "grads": [...],
// "model_copy": [...] (optional), "hyperparameters": ...}.
template <class Group, class Hyperparameters>
inline std::vector<Group> to_groups(const nb::list& groups, std::vector<Array>& keep) {
  std::vector<Group> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string name = "groups[" + std::to_string(g) + "]";
    if (!nb::isinstance<nb::dict>(groups[g])) {
      throw_argument_error(ErrorCode::invalid_argument, "gradkit", name,
                           "is not a dict; expected {'params': [...], 'grads': [...], 'hyperparameters': ...}");
    }
    const nb::dict d = nb::cast<nb::dict>(groups[g]);
    Group group;
    auto list = [&](const char* key, bool required) {
      if (!d.contains(key)) {
        if (required) throw_argument_error(ErrorCode::invalid_argument, "gradkit", name, std::string("has no '") + key + "'");
        return std::vector<TensorView>{};
      }
      ViewList v = to_views(nb::cast<Arrays>(d[key]), name + "." + key);
      keep.insert(keep.end(), v.arrays.begin(), v.arrays.end());
      return v.views;
    };
    group.params = list("params", true);
    group.grads = list("grads", true);
    group.model_copy = list("model_copy", false);
    if (d.contains("hyperparameters")) group.hyperparameters = nb::cast<Hyperparameters>(d["hyperparameters"]);
    out.push_back(std::move(group));
  }
  return out;
}

// An owning C++ object together with the arrays it holds pointers into.
template <class T>
struct Owned {
  std::vector<Array> keep;
  std::unique_ptr<T> object;
};

}  // namespace gradkit::python
