// A float64 Adam written from docs/ops.md ("adam_step"), independent of the
// library: each weight-decay mode spelled out as the spec states it. After
// each step the state is rounded to its storage dtype, as the library stores it.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "gradkit/ops/adam.h"
#include "support/test_tensor.h"

namespace gradkit::test {

struct AdamReferenceState {
  std::vector<double> w, m, v, vmax;
};

inline void reference_adam_step(AdamReferenceState& s, const std::vector<double>& grad,
                                const AdamHyperparameters& h, int64_t t, double grad_scale,
                                DType weight_dtype, DType moment_dtype) {
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2, eps = h.eps, wd = h.weight_decay;
  const double bias1 = h.bias_correction ? 1 - std::pow(b1, static_cast<double>(t)) : 1;
  const double bias2 = h.bias_correction ? 1 - std::pow(b2, static_cast<double>(t)) : 1;
  if (s.vmax.size() != s.w.size()) s.vmax.assign(s.w.size(), 0.0);
  for (size_t i = 0; i < s.w.size(); ++i) {
    double g = grad[i] / grad_scale;
    if (h.maximize) g = -g;
    double& w = s.w[i];
    if (h.decay == WeightDecay::l2) g += wd * w;
    s.m[i] = b1 * s.m[i] + (1 - b1) * g;
    s.v[i] = b2 * s.v[i] + (1 - b2) * g * g;
    double second = s.v[i];
    if (h.amsgrad) {
      s.vmax[i] = std::max(s.vmax[i], s.v[i]);
      second = s.vmax[i];
    }
    switch (h.decay) {
      case WeightDecay::l2:
      case WeightDecay::decoupled: {
        if (h.decay == WeightDecay::decoupled) w *= 1 - lr * wd;
        const double m_hat = s.m[i] / bias1, v_hat = second / bias2;
        w -= lr * m_hat / (std::sqrt(v_hat) + eps);
        break;
      }
      case WeightDecay::hugging_face: {
        const double step_size = lr * std::sqrt(bias2) / bias1;
        w -= step_size * s.m[i] / (std::sqrt(second) + eps);
        w -= lr * wd * w;
        break;
      }
    }
  }
  s.w = round_to(weight_dtype, s.w);
  s.m = round_to(moment_dtype, s.m);
  s.v = round_to(moment_dtype, s.v);
  s.vmax = round_to(moment_dtype, s.vmax);
}

}  // namespace gradkit::test
