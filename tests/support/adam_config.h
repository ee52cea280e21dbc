// One Adam test case: a name, the hyperparameters, and how the lists are
// stored. The Adam tests (f32/bf16 moments, 8-bit moments) each list their
// own cases in this one shape.
#pragma once

#include <string>

#include "gradkit/core/dtype.h"
#include "gradkit/ops/adam.h"

namespace gradkit::test {

struct AdamConfig {
  std::string name;
  AdamHyperparameters h;
  DType grad = DType::f32;
  DType moment = DType::f32;
  DType copy = DType::f32;  // f32 here means "no model copy"
  bool remainder = false;   // bf16 weights with their remainder
  float grad_scale = 1.0f;
};

}  // namespace gradkit::test
