// Muon's element-wise formulas, written once and compiled for both backends,
// in torch.optim.Muon's order of operations and roundings (docs/ops.md,
// "muon_step"): torch's lerp (a fused multiply-add on either side of 0.5),
// the Newton-Schulz input rounded to bf16, the norm and the division in
// bf16, the decay then the update, each rounded to the weight's dtype.
#pragma once

#include <cmath>

#include "spec/exact_math.h"
#include "gradkit/ops/muon.h"

namespace gradkit::spec {

// torch.lerp(self, end, weight) in f32, as ATen computes it.
GRADKIT_HD float torch_lerp(float self, float end, float weight) {
  const float diff = exact::sub(end, self);
  return std::fabs(weight) < 0.5f ? std::fma(weight, diff, self)
                                  : std::fma(exact::neg(diff), exact::sub(1.0f, weight), end);
}

// A batch's per-step constants, each rounded from double once as torch
// rounds a Python float scalar.
struct MuonCoefficients {
  float keep;             // 1 - momentum: the lerp weight of the gradient
  float momentum;         // the lerp weight of the buffer (Nesterov)
  float decay;            // 1 - lr * weight_decay
  float neg_adjusted_lr;  // -lr * the shape's adjustment
  float eps;
  bool nesterov;
};

// The shape's learning-rate factor, in double (torch.optim.Muon's
// _adjust_lr): sqrt(max(1, A / B)), or 0.2 sqrt(max(A, B)).
GRADKIT_HD double muon_lr_ratio(const MuonHyperparameters& h, int64_t rows, int64_t cols) {
  const auto a = static_cast<double>(rows), b = static_cast<double>(cols);
  if (h.adjust_lr == MuonLrAdjust::match_rms_adamw) return exact::mul(0.2, std::sqrt(a > b ? a : b));
  const double q = a / b;
  return std::sqrt(q > 1.0 ? q : 1.0);
}

// Computed where the kernels run (from the plan's table on the device, so
// that a new learning rate needs no new launch arguments: a step replayed
// from a CUDA graph sees it), in double with each operation rounded once as
// on the host.
GRADKIT_HD MuonCoefficients muon_coefficients(const MuonHyperparameters& h, int64_t rows, int64_t cols) {
  MuonCoefficients c;
  c.keep = static_cast<float>(exact::sub(1.0, h.momentum));
  c.momentum = static_cast<float>(h.momentum);
  c.decay = static_cast<float>(exact::sub(1.0, exact::mul(h.lr, h.weight_decay)));
  c.neg_adjusted_lr = static_cast<float>(exact::neg(exact::mul(h.lr, muon_lr_ratio(h, rows, cols))));
  c.eps = h.eps;
  c.nesterov = h.nesterov;
  return c;
}

// The momentum pass of one element: the new buffer value (before rounding
// to the buffer's dtype) is *buffer; the return value is the Newton-Schulz
// input before its bf16 rounding: the buffer (as stored) or, with Nesterov,
// lerp(grad, buffer, momentum) rounded to the gradient's dtype by the caller.
GRADKIT_HD float muon_momentum(float grad, float buffer, const MuonCoefficients& c) {
  return torch_lerp(buffer, grad, c.keep);
}
GRADKIT_HD float muon_nesterov(float grad, float stored_buffer, const MuonCoefficients& c) {
  return torch_lerp(grad, stored_buffer, c.momentum);
}

// The divisor of a matrix: its Frobenius norm (the square root of the sum of
// its bf16 values' squares) rounded to bf16, then clamped to eps and rounded
// again, as torch's X.norm().clamp(min=eps) of a bf16 X. `round_bf16` is the
// backend's rounding.
template <class RoundBf16>
GRADKIT_HD float muon_divisor(double sum_of_squares, float eps, RoundBf16 round_bf16) {
  const float norm = round_bf16(static_cast<float>(std::sqrt(static_cast<float>(sum_of_squares))));
  return round_bf16(norm < eps ? eps : norm);  // NaN stays NaN, as torch's clamp keeps it
}

// The weight update of one element, in two roundings as torch's mul_ then
// add_: w * decay rounded to the weight's dtype (`round_weight`), then
// w - adjusted_lr * o rounded again.
template <class RoundWeight>
GRADKIT_HD float muon_weight(float weight, float orthogonal, const MuonCoefficients& c, RoundWeight round_weight) {
  const float decayed = round_weight(exact::mul(weight, c.decay));
  return std::fma(c.neg_adjusted_lr, orthogonal, decayed);
}

}  // namespace gradkit::spec
