// An independent float64 reference of one Muon step on one matrix, written
// from torch.optim.Muon's definition (lerp momentum, optional Nesterov,
// Newton-Schulz on the bf16 matrix or its transpose, decoupled decay, the
// shape's learning-rate adjustment) and the papers' formulas for the 2026
// recipe's parts (Polar Express's per-iteration coefficients and divisor,
// MuonEq, Muon+, NorMuon, cautious weight decay; docs/ops.md). The products are accumulated in
// float64; with `bf16_products` each product and the normalised input are
// rounded to bf16 where torch's bf16 tensors round them, so that what is left
// between a backend and this is the products' accumulation order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gradkit/core/dtype.h"
#include "gradkit/core/half.h"
#include "gradkit/ops/muon.h"
#include "support/test_tensor.h"

namespace gradkit::test {

struct MuonReferenceMatrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> w, buf;  // the weight and momentum buffer, row major
  std::vector<double> second;  // NorMuon's second moment, max(rows, cols) values (zeros at first)
};

struct MuonReferenceDtypes {
  DType param = DType::f32, grad = DType::f32, momentum = DType::f32;
};

inline double round_scalar(DType dtype, double x) { return round_to(dtype, {x})[0]; }

// C (m x n) = A (m x k) B (k x n), row major, in float64.
inline std::vector<double> reference_matmul(const std::vector<double>& a, const std::vector<double>& b, int64_t m,
                                            int64_t k, int64_t n) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += a[i * k + p] * b[p * n + j];
  return c;
}

inline std::vector<double> reference_transpose(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  return t;
}

// torch's _zeropower_via_newtonschulz on a rows x cols matrix, with the
// recipe's MuonEq before it, its divisor and per-iteration coefficients.
inline std::vector<double> reference_newton_schulz(std::vector<double> x, int64_t rows, int64_t cols,
                                                   const MuonHyperparameters& h, bool bf16_products) {
  const auto r = [&](std::vector<double> v) { return bf16_products ? round_to(DType::bf16, v) : v; };
  const auto r1 = [&](double v) { return bf16_products ? round_scalar(DType::bf16, v) : v; };
  x = r(x);
  if (h.equilibrate_rows) {  // MuonEq: every row to the mean row norm ||X|| / sqrt(rows)
    double total = 0;
    for (double v : x) total += v * v;
    const double target = std::sqrt(total) / std::sqrt(static_cast<double>(rows));
    for (int64_t i = 0; i < rows; ++i) {
      double row = 0;
      for (int64_t j = 0; j < cols; ++j) row += x[i * cols + j] * x[i * cols + j];
      const double scale = r1(target / std::max(std::sqrt(row), 1e-6));
      for (int64_t j = 0; j < cols; ++j) x[i * cols + j] *= scale;
    }
    x = r(x);
  }
  const bool tall = rows > cols;
  if (tall) x = reference_transpose(x, rows, cols);
  const int64_t m = tall ? cols : rows, k = tall ? rows : cols;
  double sum = 0;
  for (double v : x) sum += v * v;
  double norm = r1(std::sqrt(sum));
  if (h.divisor == MuonDivisor::polar_express) {
    norm = r1(r1(norm * 1.01) + h.eps);
  } else {
    norm = r1(std::max(norm, static_cast<double>(h.eps)));
  }
  for (double& v : x) v /= norm;
  x = r(x);
  for (int s = 0; s < h.ns_steps; ++s) {
    const MuonNsCoefficients& t = h.ns_iteration(s);
    const double a = t.a, b = t.b, c = t.c;
    const auto gram = r(reference_matmul(x, reference_transpose(x, m, k), m, k, m));
    auto poly = reference_matmul(gram, gram, m, m, m);
    for (size_t i = 0; i < poly.size(); ++i) poly[i] = c * poly[i] + b * gram[i];
    poly = r(poly);
    auto next = reference_matmul(poly, x, m, m, k);
    for (size_t i = 0; i < next.size(); ++i) next[i] += a * x[i];
    x = r(next);
  }
  return tall ? reference_transpose(x, m, k) : x;
}

// Muon+ and NorMuon on the result o (rows x cols, in the weight's dtype):
// o scaled to a Frobenius norm of sqrt(min(rows, cols)); then each line's
// (row where rows >= cols, else column) mean square into the second moment
// (an EMA, weight 1 - beta2), o divided by its square root per line and
// scaled back to the norm it had.
inline void reference_scale_result(std::vector<double>& o, std::vector<double>& second, int64_t rows, int64_t cols,
                                   const MuonHyperparameters& h, DType param) {
  const auto rp = [&](double v) { return round_scalar(param, v); };
  if (h.renormalize) {
    double total = 0;
    for (double v : o) total += v * v;
    const double f = rp(std::sqrt(static_cast<double>(std::min(rows, cols))) / std::max(std::sqrt(total), 1e-6));
    for (double& v : o) v = rp(v * f);
  }
  if (!h.second_moment) return;
  const bool per_row = rows >= cols;
  const int64_t length = std::max(rows, cols), side = per_row ? cols : rows;
  std::vector<double> mean(static_cast<size_t>(length), 0.0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) mean[per_row ? i : j] += o[i * cols + j] * o[i * cols + j] / side;
  const double keep = static_cast<float>(1.0 - h.beta2);
  double norm = 0, scaled = 0;
  std::vector<double> step(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i) {
    second[i] = round_scalar(DType::f32, second[i] + keep * (mean[i] - second[i]));
    step[i] = 1.0 / std::sqrt(std::max(second[i], 1e-10));
    norm += mean[i] * side;
    scaled += mean[i] * side * step[i] * step[i];
  }
  const double ratio = std::sqrt(norm) / std::max(std::sqrt(scaled), 1e-10);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) o[i * cols + j] = rp(o[i * cols + j] * rp(step[per_row ? i : j] * ratio));
}

// One step; the constants are rounded to f32 as torch rounds its Python scalars.
inline void muon_reference_step(MuonReferenceMatrix& s, const std::vector<double>& g, const MuonHyperparameters& h,
                                MuonReferenceDtypes d, bool bf16_products = true) {
  const double keep = static_cast<float>(1.0 - h.momentum);
  const double mom = static_cast<float>(h.momentum);
  std::vector<double> u(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    s.buf[i] = round_scalar(d.momentum, s.buf[i] + keep * (g[i] - s.buf[i]));
    // torch's lerp with weight >= 0.5: end - (end - self) (1 - w), the same number.
    u[i] = h.nesterov ? round_scalar(d.grad, g[i] + mom * (s.buf[i] - g[i])) : s.buf[i];
  }
  auto o = reference_newton_schulz(u, s.rows, s.cols, h, bf16_products);
  if (h.renormalize || h.second_moment) {
    if (s.second.empty()) s.second.assign(static_cast<size_t>(std::max(s.rows, s.cols)), 0.0);
    reference_scale_result(o, s.second, s.rows, s.cols, h, d.param);
  }
  const double decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const double rows = static_cast<double>(s.rows), cols = static_cast<double>(s.cols);
  const double ratio = h.adjust_lr == MuonLrAdjust::match_rms_adamw ? 0.2 * std::sqrt(std::max(rows, cols))
                                                                    : std::sqrt(std::max(1.0, rows / cols));
  const double step = static_cast<float>(h.lr * ratio);
  for (size_t i = 0; i < g.size(); ++i) {
    if (h.cautious_weight_decay) {  // decay only where the update and the weight agree in sign
      const double decayed = o[i] * s.w[i] >= 0 ? step * h.weight_decay * s.w[i] : 0.0;
      s.w[i] = round_scalar(d.param, s.w[i] - (step * o[i] + decayed));
    } else {
      s.w[i] = round_scalar(d.param, round_scalar(d.param, s.w[i] * decay) - step * o[i]);
    }
  }
}

}  // namespace gradkit::test
