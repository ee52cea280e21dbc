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
  float adjusted_lr_decay;  // cautious weight decay's lr' * weight_decay, both as f32 (a tensor product)
  float eps;
  bool nesterov;
  bool cautious;
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
  c.adjusted_lr_decay = exact::mul(exact::neg(c.neg_adjusted_lr), static_cast<float>(h.weight_decay));
  c.eps = h.eps;
  c.nesterov = h.nesterov;
  c.cautious = h.cautious_weight_decay;
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
// With MuonDivisor::polar_express, bf16(bf16(1.01 n) + eps), as that of a
// bf16 X's X.norm() * 1.01 + eps.
template <class RoundBf16>
GRADKIT_HD float muon_divisor(double sum_of_squares, float eps, RoundBf16 round_bf16,
                              MuonDivisor kind = MuonDivisor::clamp) {
  const float norm = round_bf16(static_cast<float>(std::sqrt(static_cast<float>(sum_of_squares))));
  if (kind == MuonDivisor::polar_express) return round_bf16(exact::add(round_bf16(exact::mul(norm, 1.01f)), eps));
  return round_bf16(norm < eps ? eps : norm);  // NaN stays NaN, as torch's clamp keeps it
}

// ---- The recipe's parts (docs/ops.md, "muon_step", "The recipe") ----

// MuonEq's scale of one row of the bf16 input X (rows R), before its bf16
// rounding: the mean row norm ||X|| / sqrt(R) over the row's norm, clamped
// to at least 1e-6, all in f32 as of X.float().
GRADKIT_HD float muon_row_target(double matrix_sum_of_squares, int64_t rows) {
  return exact::div(std::sqrt(static_cast<float>(matrix_sum_of_squares)),
                    static_cast<float>(std::sqrt(static_cast<double>(rows))));
}
GRADKIT_HD float muon_row_scale(float target, float row_sum_of_squares) {
  const float norm = std::sqrt(row_sum_of_squares);
  return exact::div(target, norm < 1e-6f ? 1e-6f : norm);
}

// The side NorMuon's second moment runs along: one value per row when
// rows >= cols, per column otherwise (max(rows, cols) values either way).
GRADKIT_HD bool muon_per_row(int64_t rows, int64_t cols) { return rows >= cols; }

// The post-orthogonalisation scales of one matrix O (rows x cols, in the
// weight's dtype), from `sums` (per row or per column as muon_per_row says,
// `length` = max(rows, cols) of them: the sums of squares of O's values
// along the other side): Muon+'s factor f = sqrt(min(rows, cols)) / max(||O||, 1e-6)
// (1 without renormalize), and with second_moment, NorMuon's: v = f^2 sum /
// (the other side) (the scaled result's mean square), second <- lerp(second,
// v, 1 - beta2), s = rsqrt(max(second, 1e-10)), each line's factor
// s ||fO|| / max(||s f O||, 1e-10) written over its sum (1 without it). The
// norms are those of v: ||fO||^2 = sum of v times the other side.
// `reduce(i -> value)` sums a function of the line index over all lines in
// the backend's order (a loop, or a block's threads then its tree).
template <class Reduce>
GRADKIT_HD float muon_scales(const MuonHyperparameters& h, int64_t rows, int64_t cols, float* sums, float* second,
                             Reduce reduce, int64_t first, int64_t stride) {
  const int64_t length = rows >= cols ? rows : cols, other = rows >= cols ? cols : rows;
  float f = 1.0f;
  if (h.renormalize) {
    const float total = reduce([&](int64_t i) { return sums[i]; });
    const float norm = std::sqrt(total);
    f = exact::div(static_cast<float>(std::sqrt(static_cast<double>(other))), norm < 1e-6f ? 1e-6f : norm);
  }
  if (!h.second_moment) {
    for (int64_t i = first; i < length; i += stride) sums[i] = 1.0f;
    return f;
  }
  const float f2 = exact::mul(f, f), side = static_cast<float>(other);
  const float keep = static_cast<float>(exact::sub(1.0, h.beta2));
  // v_i, the new second moment and the step's sum of squares, line by line.
  for (int64_t i = first; i < length; i += stride) {
    const float v = exact::div(exact::mul(f2, sums[i]), side);
    second[i] = torch_lerp(second[i], v, keep);
    sums[i] = v;
  }
  const float norm = std::sqrt(exact::mul(reduce([&](int64_t i) { return sums[i]; }), side));
  const auto step = [&](int64_t i) {
    const float s = second[i] < 1e-10f ? 1e-10f : second[i];
    return exact::div(1.0f, std::sqrt(s));
  };
  const float scaled = std::sqrt(reduce([&](int64_t i) {
    const float s = step(i);
    return exact::mul(exact::mul(sums[i], side), exact::mul(s, s));
  }));
  const float ratio = exact::div(norm, scaled < 1e-10f ? 1e-10f : scaled);
  for (int64_t i = first; i < length; i += stride) sums[i] = exact::mul(step(i), ratio);
  return f;
}

// The weight update of one element, in two roundings as torch's mul_ then
// add_: w * decay rounded to the weight's dtype (`round_weight`), then
// w - adjusted_lr * o rounded again.
//
// With cautious weight decay, one rounding of w - (lr' o + lr' wd w [o w >= 0]).
template <class RoundWeight>
GRADKIT_HD float muon_weight(float weight, float orthogonal, const MuonCoefficients& c, RoundWeight round_weight) {
  if (c.cautious) {
    const float step = exact::mul(exact::neg(c.neg_adjusted_lr), orthogonal);
    const float decay = exact::mul(orthogonal, weight) >= 0.0f ? exact::mul(c.adjusted_lr_decay, weight) : 0.0f;
    return exact::sub(weight, exact::add(step, decay));
  }
  const float decayed = round_weight(exact::mul(weight, c.decay));
  return std::fma(c.neg_adjusted_lr, orthogonal, decayed);
}

// The result's element scaled by Muon+'s factor f then by its line's
// NorMuon factor, the factors and each product rounded to the weight's
// dtype, as a tensor of that dtype times each factor (1: exact).
template <class RoundWeight>
GRADKIT_HD float muon_scaled(float orthogonal, float f, float line, RoundWeight round_weight) {
  return round_weight(exact::mul(round_weight(exact::mul(orthogonal, round_weight(f))), round_weight(line)));
}

}  // namespace gradkit::spec
