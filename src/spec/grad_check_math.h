// The gradient check's combining rules, written once for both backends.
#pragma once

#include <cmath>

#include "spec/adam_math.h"  // GRADKIT_HD
#include "gradkit/ops/grad_check.h"

namespace gradkit::spec {

// Adds one element's contribution to a partial norm.
GRADKIT_HD double norm_accumulate(double partial, double value, NormType type) {
  if (type == NormType::infinity) {
    const double magnitude = value < 0 ? -value : value;
    return magnitude > partial ? magnitude : partial;
  }
  return partial + value * value;
}

// Combines two partials (sums add; maxima take the larger).
GRADKIT_HD double norm_combine(double a, double b, NormType type) {
  if (type == NormType::infinity) return a > b ? a : b;
  return a + b;
}

GRADKIT_HD double norm_finish(double partial, NormType type) {
  return type == NormType::infinity ? partial : std::sqrt(partial);
}

// PyTorch's clip_grad_norm_: coefficient max_norm / (norm + 1e-6), used only
// when below 1. The optimizer divides the raw gradients by S / coefficient.
GRADKIT_HD float grad_divisor(double norm, float loss_scale, float max_norm) {
  double divisor = loss_scale;
  if (max_norm > 0) {
    const double coefficient = static_cast<double>(max_norm) / (norm + 1e-6);
    if (coefficient < 1) divisor = divisor / coefficient;
  }
  return static_cast<float>(divisor);
}

// The list's results from its combined partial: the found-inf flag, the
// global norm, the divisor, and the partial itself for combining across
// lists (GradientCheckOutputs::partial).
GRADKIT_HD void write_check_outputs(const GradientCheckOutputs& out, double partial, bool nonfinite, NormType type,
                                    float loss_scale, float max_norm) {
  const double norm = nonfinite ? static_cast<double>(NAN) : norm_finish(partial, type);
  if (out.found_inf != nullptr) *out.found_inf = nonfinite;
  if (out.global_norm != nullptr) *out.global_norm = static_cast<float>(norm);
  if (out.grad_divisor != nullptr) *out.grad_divisor = nonfinite ? loss_scale : grad_divisor(norm, loss_scale, max_norm);
  if (out.partial != nullptr) {
    out.partial[0] = partial;
    out.partial[1] = nonfinite ? 1.0 : 0.0;
  }
}

// Combines lists' partials (two doubles each) in index order.
GRADKIT_HD void combine_partials(const double* partials, int count, NormType type, double* partial, bool* nonfinite) {
  *partial = 0;
  *nonfinite = false;
  for (int i = 0; i < count; ++i) {
    *partial = norm_combine(*partial, partials[2 * i], type);
    *nonfinite = *nonfinite || partials[2 * i + 1] != 0.0;
  }
}

}  // namespace gradkit::spec
