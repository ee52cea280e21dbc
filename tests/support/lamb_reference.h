// A float64 LAMB written from docs/ops.md ("lamb_step", ONNX Runtime's
// LambOptimizer), independent of the library. State is rounded to its
// storage dtype after each step, as the library stores it.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "gradkit/ops/lamb.h"
#include "support/test_tensor.h"

namespace gradkit::test {

struct LambReferenceState {
  std::vector<double> w, m, v;
  std::vector<double> last_update;  // w_new - w of the last step
};

struct LambReferenceInputs {
  double eta = 1e-3, loss_scale = 1, gradient_norm = -1;
  int64_t step = 1;
};

inline void reference_lamb_step(LambReferenceState& s, const std::vector<double>& grad, const LambHyperparameters& h,
                                const LambReferenceInputs& in, DType weight_dtype, DType moment_dtype) {
  double scale = in.loss_scale;
  if (in.gradient_norm >= 0 && h.max_norm > 0 && in.gradient_norm / scale > h.max_norm) {
    scale = scale * (in.gradient_norm / scale) / h.max_norm;
  }
  const double t = static_cast<double>(in.step);
  const double bias1 = h.bias_correction ? 1 - std::pow(static_cast<double>(h.alpha), t) : 1;
  const double bias2 = h.bias_correction ? 1 - std::pow(static_cast<double>(h.beta), t) : 1;
  const size_t n = s.w.size();
  std::vector<double> d(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    const double g = grad[i] / scale;
    m[i] = h.alpha * s.m[i] + (1 - static_cast<double>(h.alpha)) * g;
    v[i] = h.beta * s.v[i] + (1 - static_cast<double>(h.beta)) * g * g;
    d[i] = (m[i] / bias1) / (std::sqrt(v[i] / bias2) + h.epsilon) + h.lambda * s.w[i];
    if (!std::isfinite(d[i])) {  // guard: no direction, old moments
      d[i] = 0;
      m[i] = s.m[i];
      v[i] = s.v[i];
    }
  }
  double w2 = 0, d2 = 0;
  for (size_t i = 0; i < n; ++i) {
    w2 += s.w[i] * s.w[i];
    d2 += d[i] * d[i];
  }
  const double wn = std::sqrt(w2), dn = std::sqrt(d2);
  double r = 1;
  if (wn > 0 && dn > 0 && std::isfinite(wn) && std::isfinite(dn)) {
    r = std::clamp(wn / dn, static_cast<double>(h.ratio_min), static_cast<double>(h.ratio_max));
  }
  s.last_update.assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const double w_new = s.w[i] - in.eta * r * d[i];
    if (std::isfinite(w_new)) {
      s.last_update[i] = w_new - s.w[i];
      s.w[i] = w_new;
    }
  }
  s.w = round_to(weight_dtype, s.w);
  s.m = round_to(moment_dtype, m);
  s.v = round_to(moment_dtype, v);
}

}  // namespace gradkit::test
