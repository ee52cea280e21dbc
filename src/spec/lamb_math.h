// LAMB's per-element formulas, written once and compiled for both backends.
// Every operation is rounded on its own (spec/exact_math.h), so both
// backends give the same bits for the same inputs; with 8- or 4-bit moments
// the whole step is then the same bit for bit (the norms are summed in one
// order too: spec/lamb_low_bit.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "spec/exact_math.h"
#include "spec/master_math.h"  // float_bits
#include "gradkit/ops/lamb.h"

namespace gradkit::spec {

// A group's constants for one step, in the compute type C.
template <class C>
struct LambCoefficients {
  C alpha, beta, one_minus_alpha, one_minus_beta, lambda, epsilon;
  C inv_bias1, inv_bias2;  // 1 / (1 - alpha^t), 1 / (1 - beta^t); 1 without bias correction
  C grad_divisor;          // loss scale, enlarged by clipping
  C eta;
  // The low-bit moments' form (lamb_moments_folded): 1 / grad_divisor,
  // eps sqrt(1 - beta^t) and sqrt(1 - beta^t) / (1 - alpha^t) (eps and 1
  // without bias correction).
  C inv_grad_divisor, folded_eps, folded_direction;
};

// Clipping as ONNX Runtime specifies it: scale = loss_scale, enlarged to
// gradient_norm / max_norm when the unscaled norm exceeds max_norm.
template <class C>
GRADKIT_HD LambCoefficients<C> lamb_coefficients(const LambHyperparameters& h, double eta, double loss_scale,
                                                 double gradient_norm, int64_t step) {
  double scale = loss_scale;
  if (gradient_norm >= 0 && h.max_norm > 0 && gradient_norm / loss_scale > h.max_norm) {
    scale = scale * (gradient_norm / loss_scale) / h.max_norm;
  }
  LambCoefficients<C> c;
  c.alpha = static_cast<C>(h.alpha);
  c.beta = static_cast<C>(h.beta);
  c.one_minus_alpha = static_cast<C>(1.0 - static_cast<double>(h.alpha));
  c.one_minus_beta = static_cast<C>(1.0 - static_cast<double>(h.beta));
  c.lambda = static_cast<C>(h.lambda);
  c.epsilon = static_cast<C>(h.epsilon);
  // exact::power, not std::pow: the host's and the device's pow may differ in the last bit.
  const double bias1 = h.bias_correction ? 1.0 - exact::power(h.alpha, step) : 1.0;
  const double bias2 = h.bias_correction ? 1.0 - exact::power(h.beta, step) : 1.0;
  c.inv_bias1 = static_cast<C>(1.0 / bias1);  // 1 without bias correction, exactly
  c.inv_bias2 = static_cast<C>(1.0 / bias2);
  c.grad_divisor = static_cast<C>(scale);
  c.eta = static_cast<C>(eta);
  const double root_bias2 = std::sqrt(bias2);
  c.inv_grad_divisor = static_cast<C>(1.0 / scale);
  c.folded_eps = static_cast<C>(static_cast<double>(h.epsilon) * root_bias2);
  c.folded_direction = static_cast<C>(root_bias2 / bias1);
  return c;
}

// New moments from the gradient (m, v in/out).
template <class C>
GRADKIT_HD void lamb_moments(C g, C& m, C& v, const LambCoefficients<C>& c) {
  using exact::add;
  using exact::mul;
  g = g / c.grad_divisor;
  m = add(mul(c.alpha, m), mul(c.one_minus_alpha, g));
  v = add(mul(c.beta, v), mul(mul(c.one_minus_beta, g), g));
}

// The direction d from the (stored) moments and the weight.
template <class C>
GRADKIT_HD C lamb_direction(C w, C m, C v, const LambCoefficients<C>& c) {
  using exact::add;
  using exact::mul;
  return add(mul(m, c.inv_bias1) / add(std::sqrt(mul(v, c.inv_bias2)), c.epsilon), mul(c.lambda, w));
}

// The low-bit moments' form (8- and 4-bit, which have no twin to match; the
// f32 moments keep the two functions above): the same quantities, equal in
// exact arithmetic, in fewer roundings and instructions, as Adam's folded
// form (spec/adam_math.h). The gradient times 1 / grad_divisor; the
// moments as fused multiply-adds, m + (1 - alpha) (g - m) and
// v beta + ((1 - beta) g) g; the square root of v's bias correction folded
// into eps and the direction's scale, once per step in f64:
//   d = (sqrt(bias2) / bias1) (m (1 / (sqrt(v) + eps sqrt(bias2)))) + lambda w,
// with one correctly rounded reciprocal an element in place of a division,
// a square root's product and a division (cuda/denominator_lanes.cuh takes a
// lane's eight reciprocals under one range test, the same bits).
template <class C>
GRADKIT_HD void lamb_moments_folded(C g, C& m, C& v, const LambCoefficients<C>& c) {
  using exact::fma;
  g = exact::mul(g, c.inv_grad_divisor);
  m = fma(c.one_minus_alpha, exact::sub(g, m), m);
  v = fma(v, c.beta, exact::mul(exact::mul(c.one_minus_beta, g), g));
}

// 1 / (sqrt(v) + folded eps), each operation correctly rounded.
template <class C>
GRADKIT_HD C lamb_folded_reciprocal(C v, const LambCoefficients<C>& c) {
  return exact::reciprocal(exact::add(std::sqrt(v), c.folded_eps));
}

// The direction from the stored m, lamb_folded_reciprocal of the stored v,
// and the weight.
template <class C>
GRADKIT_HD C lamb_direction_folded(C w, C m, C reciprocal, const LambCoefficients<C>& c) {
  return exact::fma(c.folded_direction, exact::mul(m, reciprocal), exact::mul(c.lambda, w));
}

// Pass 2's new weight w - step * d (step = eta times the trust ratio).
template <class C>
GRADKIT_HD C lamb_apply(C w, C step, C d) {
  return exact::sub(w, exact::mul(step, d));
}

template <class C>
GRADKIT_HD bool finite(C x) {
  return x - x == C(0);  // false for Inf and NaN, and unaffected by fast-math flags
}

// !finite(x) as an integer, 1 for Inf and NaN (an exponent of all ones): an
// OR of these over a loop vectorizes, where a bool reduction over finite()
// stays scalar (cpu/lamb_low_bit.h).
GRADKIT_HD uint32_t non_finite_bit(float x) {
  return static_cast<uint32_t>((float_bits(x) & 0x7f800000u) == 0x7f800000u);
}

// The trust ratio from the two squared norms.
GRADKIT_HD float lamb_ratio(double w_squares, double d_squares, const LambHyperparameters& h) {
  const double w_norm = std::sqrt(w_squares), d_norm = std::sqrt(d_squares);
  if (!(w_norm > 0) || !(d_norm > 0) || !finite(w_norm) || !finite(d_norm)) return 1.0f;
  double r = w_norm / d_norm;
  r = r < h.ratio_min ? h.ratio_min : r;
  r = r > h.ratio_max ? h.ratio_max : r;
  return static_cast<float>(r);
}

}  // namespace gradkit::spec
