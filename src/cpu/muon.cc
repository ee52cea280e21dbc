// Muon on the CPU: the element passes as loops over the batch's chunk table,
// the Newton-Schulz products through the BLAS (sgemm on f32 copies of the
// bf16 values, rounded to bf16 after each product as the GPU's epilogue
// rounds), one matrix at a time.
#include <algorithm>
#include <cstring>
#include <vector>

#include "spec/muon.h"
#include "spec/muon_math.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"
#include "gradkit/core/error.h"

#if defined(GRADKIT_WITH_BLAS)
#include <cblas.h>
#endif

namespace gradkit::spec {
namespace {

float round_bf16(float x) { return static_cast<float>(bfloat16(x)); }

// Workspace layout (f32): X of every matrix of the batch, then one matrix's
// second buffer, its two Gram products, a partial sum per chunk, and the
// post-orthogonalisation scales: per matrix, max(rows, cols) line factors
// and Muon+'s factor.
struct CpuWorkspace {
  float* x;
  float* x_next;
  float* gram;
  float* poly;
  float* partials;
  float* lines;
  float* factors;

  CpuWorkspace(const MuonPlan::Batch& b, void* base) {
    const int64_t elements = b.rows * b.cols, m = std::min(b.rows, b.cols);
    x = static_cast<float*>(base);  // first: an orthogonalize batch's plan lists these matrices
    x_next = x + b.count * elements;
    gram = x_next + elements;
    poly = gram + m * m;
    partials = poly + m * m;
    lines = partials + b.plan.chunks().size();
    factors = lines + b.count * std::max(b.rows, b.cols);
  }
};

// Whether the step scales the result after Newton-Schulz (Muon+, NorMuon).
bool scales_result(const MuonHyperparameters& h) { return h.renormalize || h.second_moment; }

// The momentum pass: the buffers, and the Newton-Schulz input rounded to
// bf16, to the batch's matrices in the workspace with each chunk's sum of
// squares (whole), or to the rows' places in the exchange buffer, list 3
// (a sharded plan's momentum part).
template <class P, class G, class M>
void momentum_pass(const MuonLaunch& l, const MuonCoefficients& c, const CpuWorkspace* w) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
  cpu::for_each_chunk(b.plan, [&](const cpu::ChunkView& v) {
    const G* grad = v.tensor<G>(1);
    M* buffer = v.tensor<M>(2);
    float* x = w != nullptr ? w->x + v.chunk.tensor * elements + v.chunk.begin : nullptr;
    bfloat16* rows = w != nullptr ? nullptr : v.tensor<bfloat16>(3);
    const float scale = l.grad_scale_device != nullptr ? *l.grad_scale_device : l.grad_scale;
    float sum = 0.0f;
    for (int32_t i = 0; i < v.chunk.length; ++i) {
      const float g = cpu::to_compute<float>(grad[i]) / scale;
      const M stored = cpu::from_compute<M>(muon_momentum(g, cpu::to_compute<float>(buffer[i]), c));
      buffer[i] = stored;
      const float s = cpu::to_compute<float>(stored);
      // Nesterov's input has the gradient's dtype (torch: grad.lerp(buf)).
      const float u = c.nesterov ? cpu::to_compute<float>(cpu::from_compute<G>(muon_nesterov(g, s, c))) : s;
      if (rows != nullptr) {
        rows[i] = bfloat16(u);
        continue;
      }
      x[i] = round_bf16(u);
      sum += x[i] * x[i];
    }
    if (w != nullptr) w->partials[v.index] = sum;
  });
}

// Where each element of an owned matrix lies in the exchange buffer: in the
// piece of the rank that holds it (MuonPiece). A chunk's elements go up, so
// the piece found for one is where the search for the next begins.
class PieceFinder {
 public:
  PieceFinder(const MuonLaunch& l, int64_t matrix, int64_t cols)
      : pieces_(l.pieces + matrix * l.ranks), ranks_(l.ranks), by_rows_(l.pieces_by_rows), cols_(cols) {}
  int64_t operator()(int64_t e) {
    const int64_t i = e / cols_, j = e - i * cols_;
    s_ = by_rows_ ? row_piece_holding(pieces_, ranks_, s_, e, cols_) : piece_holding(pieces_, ranks_, s_, i, j);
    return piece_element(pieces_[s_], i, j);
  }

 private:
  const MuonPiece* pieces_;
  int32_t ranks_;
  bool by_rows_;
  int64_t cols_;
  int32_t s_ = 0;
};

// An orthogonalize batch's matrices from the ranks' pieces in the exchange
// buffer, with each chunk's sum of squares as the momentum pass makes them.
void assemble(const MuonLaunch& l, const CpuWorkspace& w) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
  const auto* exchange = static_cast<const bfloat16*>(l.exchange);
  cpu::for_each_chunk(b.plan, [&](const cpu::ChunkView& v) {
    PieceFinder at(l, v.chunk.tensor, b.cols);
    float* x = w.x + v.chunk.tensor * elements + v.chunk.begin;
    float sum = 0.0f;
    for (int32_t i = 0; i < v.chunk.length; ++i) {
      x[i] = static_cast<float>(exchange[at(v.chunk.begin + i)]);
      sum += x[i] * x[i];
    }
    w.partials[v.index] = sum;
  });
}

// The orthogonalised matrices' pieces back where each rank's came from.
void disperse(const MuonLaunch& l, const CpuWorkspace& w) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
  auto* exchange = static_cast<bfloat16*>(l.exchange);
  cpu::for_each_chunk(b.plan, [&](const cpu::ChunkView& v) {
    PieceFinder at(l, v.chunk.tensor, b.cols);
    const float* x = w.x + v.chunk.tensor * elements + v.chunk.begin;
    for (int32_t i = 0; i < v.chunk.length; ++i) exchange[at(v.chunk.begin + i)] = bfloat16(x[i]);
  });
}

// Each matrix's sum of squares: its chunks' partials, in chunk order.
std::vector<double> matrix_sums(const MuonPlan::Batch& b, const CpuWorkspace& w) {
  const auto chunks = b.plan.chunks();
  std::vector<double> sums(static_cast<size_t>(b.count), 0.0);
  for (size_t k = 0; k < chunks.size(); ++k) sums[static_cast<size_t>(chunks[k].tensor)] += w.partials[k];
  return sums;
}

// MuonEq: each row of each matrix scaled to the matrix's mean row norm (its
// Frobenius norm from `sums`), rounded to bf16; `sums` becomes the scaled
// matrices' sums of squares, for the normalisation.
void equilibrate(const MuonLaunch& l, const CpuWorkspace& w, std::vector<double>& sums) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
#pragma omp parallel for
  for (int64_t m = 0; m < b.count; ++m) {
    const float target = muon_row_target(sums[static_cast<size_t>(m)], b.rows);
    float total = 0.0f;
    for (int64_t r = 0; r < b.rows; ++r) {
      float* row = w.x + m * elements + r * b.cols;
      float row_sum = 0.0f;
      for (int64_t j = 0; j < b.cols; ++j) row_sum += row[j] * row[j];
      const float scale = round_bf16(muon_row_scale(target, row_sum));
      for (int64_t j = 0; j < b.cols; ++j) {
        row[j] = round_bf16(row[j] * scale);
        total += row[j] * row[j];
      }
    }
    sums[static_cast<size_t>(m)] = total;
  }
}

// Muon+ and NorMuon: each matrix's sums of squares along its lines (rows
// where rows >= cols, else columns), then muon_scales: the line factors
// over the sums, Muon+'s factor, and (NorMuon) the second moment updated.
void scale_result(const MuonLaunch& l, const CpuWorkspace& w) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols, length = std::max(b.rows, b.cols);
  const bool per_row = muon_per_row(b.rows, b.cols);
#pragma omp parallel for
  for (int64_t m = 0; m < b.count; ++m) {
    const float* o = w.x + m * elements;
    float* sums = w.lines + m * length;
    std::fill(sums, sums + length, 0.0f);
    for (int64_t r = 0; r < b.rows; ++r)
      for (int64_t j = 0; j < b.cols; ++j) sums[per_row ? r : j] += o[r * b.cols + j] * o[r * b.cols + j];
    float* second = b.second_moment != nullptr ? b.second_moment[m] : nullptr;
    const auto reduce = [&](auto value) {
      float total = 0.0f;
      for (int64_t i = 0; i < length; ++i) total += value(i);
      return total;
    };
    w.factors[m] = muon_scales(*l.hyper, b.rows, b.cols, sums, second, reduce, 0, 1);
  }
}

// Divides each matrix by its divisor (from its sum of squares).
void normalise(const MuonLaunch& l, const MuonCoefficients& c, const CpuWorkspace& w,
               const std::vector<double>& sums) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
#pragma omp parallel for
  for (int64_t m = 0; m < b.count; ++m) {
    const float divisor = muon_divisor(sums[static_cast<size_t>(m)], c.eps, round_bf16, l.hyper->divisor);
    float* x = w.x + m * elements;
    for (int64_t i = 0; i < elements; ++i) x[i] = round_bf16(x[i] / divisor);
  }
}

void round_all(float* x, int64_t n) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

#if defined(GRADKIT_WITH_BLAS)
// ns_steps iterations on one rows x cols matrix at x (row major), torch's
// algorithm on X (rows <= cols) or on its transpose Y (rows > cols), here
// written on X itself: A = X Xt (or Xt X), B = b A + c A A, X' = a X + B X
// (or a X + X Bt). Ends with the result at x.
void newton_schulz(float* x, const CpuWorkspace& w, int64_t rows, int64_t cols, const MuonHyperparameters& h) {
  const bool wide = rows <= cols;
  const int64_t m = wide ? rows : cols, elements = rows * cols;
  const auto R = static_cast<blasint>(rows), C = static_cast<blasint>(cols), M = static_cast<blasint>(m);
  float* in = x;
  float* out = w.x_next;
  for (int32_t s = 0; s < h.ns_steps; ++s) {
    const MuonNsCoefficients& k = h.ns_iteration(s);
    if (wide) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, M, C, 1.0f, in, C, in, C, 0.0f, w.gram, M);
    else cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, M, M, R, 1.0f, in, C, in, C, 0.0f, w.gram, M);
    round_all(w.gram, m * m);
    std::memcpy(w.poly, w.gram, sizeof(float) * static_cast<size_t>(m * m));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, M, M, k.c, w.gram, M, w.gram, M, k.b, w.poly, M);
    round_all(w.poly, m * m);
    std::memcpy(out, in, sizeof(float) * static_cast<size_t>(elements));
    if (wide) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, C, R, 1.0f, w.poly, M, in, C, k.a, out, C);
    else cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, C, C, 1.0f, in, C, w.poly, M, k.a, out, C);
    round_all(out, elements);
    std::swap(in, out);
  }
  if (in != x) std::memcpy(x, in, sizeof(float) * static_cast<size_t>(elements));
}
#endif

// The weight update from the workspace's matrices (whole), or from the
// rows' places in the exchange buffer, list 3 (a sharded plan's update).
template <class P>
void weight_pass(const MuonLaunch& l, const MuonCoefficients& c, const CpuWorkspace* w) {
  const MuonPlan::Batch& b = *l.batch;
  const int64_t elements = b.rows * b.cols;
  cpu::for_each_chunk(b.plan, [&](const cpu::ChunkView& v) {
    P* param = v.tensor<P>(0);
    const float* o = w != nullptr ? w->x + v.chunk.tensor * elements + v.chunk.begin : nullptr;
    const bfloat16* rows = w != nullptr ? nullptr : v.tensor<bfloat16>(3);
    const auto round_weight = [](float x) { return cpu::to_compute<float>(cpu::from_compute<P>(x)); };
    // The result's scales (Muon+, NorMuon) where the step has them.
    const bool scaled = w != nullptr && scales_result(*l.hyper);
    const bool per_row = muon_per_row(b.rows, b.cols);
    const float* lines = scaled ? w->lines + v.chunk.tensor * std::max(b.rows, b.cols) : nullptr;
    const float f = scaled ? w->factors[v.chunk.tensor] : 1.0f;
    for (int32_t i = 0; i < v.chunk.length; ++i) {
      float update = rows != nullptr ? static_cast<float>(rows[i]) : o[i];
      if (scaled) {
        const int64_t e = v.chunk.begin + i;
        update = muon_scaled(update, f, lines[per_row ? e / b.cols : e % b.cols], round_weight);
      }
      param[i] = cpu::from_compute<P>(muon_weight(cpu::to_compute<float>(param[i]), update, c, round_weight));
    }
  });
}

void orthogonalise(const MuonLaunch& l, const MuonCoefficients& c, const CpuWorkspace& w) {
  const MuonPlan::Batch& b = *l.batch;
  std::vector<double> sums = matrix_sums(b, w);
  if (l.hyper->equilibrate_rows) equilibrate(l, w, sums);
  normalise(l, c, w, sums);
#if defined(GRADKIT_WITH_BLAS)
  for (int64_t m = 0; m < b.count; ++m) newton_schulz(w.x + m * b.rows * b.cols, w, b.rows, b.cols, *l.hyper);
#endif
}

template <class P, class G, class M>
void run(const MuonLaunch& l) {
  const MuonPlan::Batch& b = *l.batch;
  const MuonCoefficients c = muon_coefficients(*l.hyper, b.rows, b.cols);
  if (l.stage == MuonStage::momentum) return momentum_pass<P, G, M>(l, c, nullptr);
  if (l.stage == MuonStage::update) return weight_pass<P>(l, c, nullptr);
  const CpuWorkspace w(b, l.workspace);
  momentum_pass<P, G, M>(l, c, &w);
  orthogonalise(l, c, w);
  if (scales_result(*l.hyper)) scale_result(l, w);
  weight_pass<P>(l, c, &w);
}

template <class P, class G>
void dispatch_momentum(const MuonLaunch& l) {
  if (l.batch->plan.dtype(2) == DType::f32) run<P, G, float>(l);
  else run<P, G, bfloat16>(l);
}

template <class P>
void dispatch_grad(const MuonLaunch& l) {
  switch (l.batch->plan.dtype(1)) {
    case DType::f32: return dispatch_momentum<P, float>(l);
    case DType::f16: return dispatch_momentum<P, half>(l);
    default: return dispatch_momentum<P, bfloat16>(l);
  }
}

}  // namespace

size_t muon_cpu_workspace_bytes(int64_t count, int64_t rows, int64_t cols, size_t chunks) {
  const int64_t elements = rows * cols, m = std::min(rows, cols);
  const auto floats =
      (count + 1) * elements + 2 * m * m + static_cast<int64_t>(chunks) + count * (std::max(rows, cols) + 1);
  return sizeof(float) * static_cast<size_t>(floats);
}

size_t muon_cpu_workspace_bytes(const MuonPlan::Batch& b) {
  return muon_cpu_workspace_bytes(b.count, b.rows, b.cols, b.plan.chunks().size());
}

void muon_cpu(const MuonLaunch& l) {
#if !defined(GRADKIT_WITH_BLAS)
  throw Error(ErrorCode::backend_unavailable,
              "muon_step: the CPU backend needs a BLAS (OpenBLAS), and gradkit was built without one "
              "(scripts/setup installs libopenblas-dev; then rebuild)");
#endif
  if (l.found_inf != nullptr && *l.found_inf) return;
  if (l.stage == MuonStage::orthogonalize) {
    const MuonPlan::Batch& b = *l.batch;
    const CpuWorkspace w(b, l.workspace);
    assemble(l, w);
    orthogonalise(l, muon_coefficients(*l.hyper, b.rows, b.cols), w);
    return disperse(l, w);
  }
  if (l.batch->plan.dtype(0) == DType::f32) dispatch_grad<float>(l);
  else dispatch_grad<bfloat16>(l);
}

}  // namespace gradkit::spec
