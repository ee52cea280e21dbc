// The Adam update of one element, written once and compiled for both
// backends (host and device), so that the CPU and CUDA backends compute the
// same formula in the same order, with the same roundings.
#pragma once

#include <cmath>
#include <cstdint>

#include "spec/exact_math.h"
#include "gradkit/ops/adam.h"

namespace gradkit::spec {

// A group's constants for one step, in the compute type C (f32, or f64 for
// f64 data). Bias corrections are computed in f64 from the step count.
template <class C>
struct AdamCoefficients {
  C beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  C step_size;        // lr / (1 - beta1^t); Hugging Face: lr * sqrt(1 - beta2^t) / (1 - beta1^t)
  C bias2_sqrt;       // sqrt(1 - beta2^t)
  C decay_factor;     // decoupled: 1 - lr * weight_decay
  C decay_after;      // Hugging Face: lr * weight_decay
  // The low-bit form's constants (AdamForm::folded): lr * sqrt(1 - beta2^t) /
  // (1 - beta1^t) and eps * sqrt(1 - beta2^t) (Hugging Face: step_size, eps).
  C folded_step_size, folded_eps;
  int32_t decay;
  bool amsgrad, maximize;
};

template <class C>
GRADKIT_HD AdamCoefficients<C> adam_coefficients(const AdamHyperparameters& h, double lr, int64_t step) {
  using exact::mul;
  using exact::sub;
  const double bias1 = h.bias_correction ? sub(1.0, exact::power(h.beta1, step)) : 1.0;
  const double bias2 = h.bias_correction ? sub(1.0, exact::power(h.beta2, step)) : 1.0;
  const double wd = h.weight_decay;
  AdamCoefficients<C> c;
  c.beta1 = static_cast<C>(h.beta1);
  c.beta2 = static_cast<C>(h.beta2);
  c.one_minus_beta1 = static_cast<C>(sub(1.0, static_cast<double>(h.beta1)));
  c.one_minus_beta2 = static_cast<C>(sub(1.0, static_cast<double>(h.beta2)));
  c.eps = static_cast<C>(h.eps);
  c.weight_decay = static_cast<C>(wd);
  c.decay = static_cast<int32_t>(h.decay);
  c.bias2_sqrt = static_cast<C>(std::sqrt(bias2));
  // Hugging Face's step size, and every mode's in the folded form.
  const double folded_step = mul(lr, std::sqrt(bias2)) / bias1;
  c.step_size = static_cast<C>(h.decay == WeightDecay::hugging_face ? folded_step : lr / bias1);
  c.decay_factor = static_cast<C>(sub(1.0, mul(lr, wd)));
  c.decay_after = static_cast<C>(mul(lr, wd));
  c.folded_step_size = static_cast<C>(folded_step);
  c.folded_eps = h.decay == WeightDecay::hugging_face ? c.eps : static_cast<C>(mul(static_cast<double>(h.eps), std::sqrt(bias2)));
  c.amsgrad = h.amsgrad;
  c.maximize = h.maximize;
  return c;
}

// The per-launch flags of the update, from two sources. AdamFlags fixes them
// at compile time, so that the element function below has no branch and a
// loop over it vectorizes (the CPU backend instantiates one loop per flag
// combination, picked once per chunk: src/cpu/adam_kernel.h); RuntimeAdamFlags
// reads them from the coefficients, a branch that is uniform across a launch
// (the CUDA kernels, where that costs nothing). Both run the same formula.
template <WeightDecay Decay, bool Amsgrad, bool Maximize>
struct AdamFlags {
  static constexpr int32_t decay = static_cast<int32_t>(Decay);
  static constexpr bool amsgrad = Amsgrad, maximize = Maximize;
};

struct RuntimeAdamFlags {
  int32_t decay;
  bool amsgrad, maximize;
};

// Which form of the update an element takes. torch: as torch.optim and
// Transformers order it (below), for every path that has a twin to match.
// folded: the low-bit moments' paths (8- and 4-bit), which have none
// (adam_element_folded).
enum class AdamForm { torch, folded };

// The low-bit moments' update (AdamForm::folded): the same quantities as
// the torch form, equal to it in exact arithmetic, in fewer roundings and
// instructions. The square root of v's bias correction is folded into the
// step size and eps, once per step in f64,
//   w = w - (lr sqrt(bias2) / bias1) * (m * (1 / (sqrt(v) + eps sqrt(bias2)))),
// with one correctly rounded reciprocal per element and a product, instead
// of two divisions (on CUDA a division is a reciprocal, its refinement, a
// quotient and its correction, a range check and a slow-path branch each;
// the reciprocal is the first two, and cuda/denominator_lanes.cuh takes a
// lane's eight without a test of their own); Hugging Face's form is already
// this one. Every multiply-add is fused (exact::fma, one rounding, the same
// bits on both backends): the moments as m + (1 - beta1) * (g - m)
// (Transformers: m * beta1 + (1 - beta1) * g) and v * beta2 + ((1 - beta2) *
// g) * g, the L2 term, the step and Hugging Face's decay, three fewer
// instructions an element on CUDA. No amsgrad: low-bit moments refuse it
// (gradkit/ops/adam.h). In three parts, so that a kernel may take the square
// roots and reciprocals between them its own way (cuda/
// denominator_lanes.cuh, the same bits): the moments (and the decay applied
// to w before the step), the reciprocal of the denominator from v, then the
// step from it.
template <class C, class Flags>
GRADKIT_HD void adam_moments_folded(C& w, C g, C& m, C& v, const AdamCoefficients<C>& c, Flags f) {
  using exact::fma;
  using exact::mul;
  const bool hugging_face = f.decay == static_cast<int32_t>(WeightDecay::hugging_face);
  if (f.maximize) g = exact::neg(g);
  if (f.decay == static_cast<int32_t>(WeightDecay::l2)) g = fma(c.weight_decay, w, g);
  if (f.decay == static_cast<int32_t>(WeightDecay::decoupled)) w = mul(w, c.decay_factor);
  m = hugging_face ? fma(m, c.beta1, mul(c.one_minus_beta1, g)) : fma(c.one_minus_beta1, exact::sub(g, m), m);
  v = fma(v, c.beta2, mul(mul(c.one_minus_beta2, g), g));
}

// 1 / (sqrt(v) + folded eps), each operation correctly rounded.
template <class C>
GRADKIT_HD C folded_denominator_reciprocal(C v, const AdamCoefficients<C>& c) {
  return exact::reciprocal(exact::add(std::sqrt(v), c.folded_eps));
}

// reciprocal: folded_denominator_reciprocal(v).
template <class C, class Flags>
GRADKIT_HD void adam_step_folded(C& w, C m, C reciprocal, const AdamCoefficients<C>& c, Flags f) {
  using exact::fma;
  using exact::neg;
  w = fma(neg(c.folded_step_size), exact::mul(m, reciprocal), w);
  if (f.decay == static_cast<int32_t>(WeightDecay::hugging_face)) w = fma(neg(c.decay_after), w, w);
}

template <class C, class Flags>
GRADKIT_HD void adam_element_folded(C& w, C g, C& m, C& v, const AdamCoefficients<C>& c, Flags f) {
  adam_moments_folded(w, g, m, v, c, f);
  adam_step_folded(w, m, folded_denominator_reciprocal(v, c), c, f);
}

// One element: w, m, v (and vmax for amsgrad) updated in place from the
// unscaled gradient g (already divided by the gradient scale). The order of
// operations follows the library each mode comes from (torch.optim for l2
// and decoupled, Transformers for hugging_face), so that results agree with
// theirs to rounding: the first moment as PyTorch's lerp (m + (1 - beta1) *
// (g - m)) or as Transformers' m * beta1 + (1 - beta1) * g, and the update
// as addcdiv (w - step_size * (m / denom)). Every operation is rounded on
// its own (exact_math.h), so both backends give the same bits. Form ==
// folded runs adam_element_folded (vmax unused).
template <class C, class Flags, AdamForm Form = AdamForm::torch>
GRADKIT_HD void adam_element(C& w, C g, C& m, C& v, C& vmax, const AdamCoefficients<C>& c, Flags f) {
  if constexpr (Form == AdamForm::folded) {
    adam_element_folded(w, g, m, v, c, f);
  } else {
    using exact::add;
    using exact::mul;
    using exact::sub;
    const bool hugging_face = f.decay == static_cast<int32_t>(WeightDecay::hugging_face);
    if (f.maximize) g = exact::neg(g);
    if (f.decay == static_cast<int32_t>(WeightDecay::l2)) g = add(g, mul(c.weight_decay, w));
    if (f.decay == static_cast<int32_t>(WeightDecay::decoupled)) w = mul(w, c.decay_factor);
    m = hugging_face ? add(mul(m, c.beta1), mul(c.one_minus_beta1, g)) : add(m, mul(c.one_minus_beta1, sub(g, m)));
    v = add(mul(v, c.beta2), mul(mul(c.one_minus_beta2, g), g));
    C second = v;
    if (f.amsgrad) {
      vmax = vmax > v ? vmax : v;
      second = vmax;
    }
    const C denom = hugging_face ? add(std::sqrt(second), c.eps) : add(std::sqrt(second) / c.bias2_sqrt, c.eps);
    w = sub(w, mul(c.step_size, m / denom));
    if (hugging_face) w = sub(w, mul(c.decay_after, w));
  }
}

// The same with the flags read from the coefficients.
template <class C>
GRADKIT_HD void adam_element(C& w, C g, C& m, C& v, C& vmax, const AdamCoefficients<C>& c) {
  adam_element(w, g, m, v, vmax, c, RuntimeAdamFlags{c.decay, c.amsgrad, c.maximize});
}

}  // namespace gradkit::spec
