// LAMB on the CPU: the same two passes and the same per-element formulas as
// the CUDA backend (backend/lamb.h, backend/lamb_math.h), and each tensor's
// chunk sums added in the CUDA ratio kernel's order.
#include <cmath>
#include <type_traits>
#include <vector>

#include "backend/lamb.h"
#include "backend/lamb_blockwise.h"
#include "backend/lamb_math.h"
#include "cpu/lamb_8bit.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::backend {
namespace {

// The element loops of both passes for moments stored as M (f32, bf16; f64
// with f64 weights); 8-bit moments: cpu/lamb_8bit.h.
template <class W, class G, class M>
struct PlainMoments {
  using C = cpu::compute_t<W>;
  using Weight = W;

  // Pass 1 over a chunk: new moments, and the chunk's sums of w^2 and d^2.
  static void norms(const cpu::ChunkView& chunk, const LambLaunch&, const LambCoefficients<C>& c, double& w2c,
                    double& d2c) {
    const W* w = chunk.tensor<W>(0);
    const G* g = chunk.tensor<G>(1);
    M* m = chunk.tensor<M>(2);
    M* v = chunk.tensor<M>(3);
    for (int i = 0; i < chunk.chunk.length; ++i) {
      const C wc = cpu::to_compute<C>(w[i]);
      C mc = cpu::to_compute<C>(m[i]), vc = cpu::to_compute<C>(v[i]);
      lamb_moments(cpu::to_compute<C>(g[i]), mc, vc, c);
      const M m_stored = cpu::from_compute<M>(mc), v_stored = cpu::from_compute<M>(vc);
      const C d = lamb_direction(wc, cpu::to_compute<C>(m_stored), cpu::to_compute<C>(v_stored), c);
      if (finite(d)) {
        m[i] = m_stored;
        v[i] = v_stored;
        d2c += static_cast<double>(d) * d;
      } else {
        v[i] = cpu::from_compute<M>(-cpu::to_compute<C>(v[i]));  // mark (see backend/lamb.h)
      }
      w2c += static_cast<double>(wc) * wc;
    }
  }

  // Pass 2 over a chunk: store(i, w_old, w_new) for each element.
  template <class Store>
  static void update(const cpu::ChunkView& chunk, const LambLaunch&, const LambCoefficients<C>& c, C step_size,
                     const Store& store) {
    const W* w = chunk.tensor<W>(0);
    const M* m = chunk.tensor<M>(2);
    M* v = chunk.tensor<M>(3);
    for (int i = 0; i < chunk.chunk.length; ++i) {
      const C w_old = cpu::to_compute<C>(w[i]);
      const C vc = cpu::to_compute<C>(v[i]);
      C w_new = w_old;
      if (std::signbit(vc)) {
        v[i] = cpu::from_compute<M>(-vc);
      } else {
        const C updated = lamb_apply(w_old, step_size, lamb_direction(w_old, cpu::to_compute<C>(m[i]), vc, c));
        if (finite(updated)) w_new = updated;
      }
      store(i, w_old, w_new);
    }
  }
};

template <class Moments>
void run(const MultiTensorPlan& plan, const LambLaunch& l) {
  using W = typename Moments::Weight;
  using C = typename Moments::C;
  const LambStepInputs& in = l.inputs;
  const double eta = in.eta_device != nullptr ? *in.eta_device : in.eta;
  const double scale = in.loss_scale_device != nullptr ? *in.loss_scale_device : in.loss_scale;
  const double norm = in.gradient_norm_device != nullptr ? *in.gradient_norm_device : in.gradient_norm;
  const int64_t step = in.step_device != nullptr ? *in.step_device : in.step;
  const auto chunks = plan.chunks();
  auto coefficients = [&](const cpu::ChunkView& chunk) {
    return lamb_coefficients<C>(l.groups[plan.groups()[chunk.chunk.tensor]], eta, scale, norm, step);
  };

  const LambSplit& split = in.split;
  std::vector<double> w2(plan.num_tensors(), 0.0), d2(plan.num_tensors(), 0.0);
  if (split.pass == LambPass::second) {
    // The whole tensors' sums, every row's added in row order.
    for (size_t t = 0; t < plan.num_tensors(); ++t) {
      for (int r = 0; r < split.rows; ++r) {
        const double* row = split.sums + r * split.row_stride + 2 * static_cast<int64_t>(split.index[t]);
        w2[t] += row[0];
        d2[t] += row[1];
      }
    }
  } else {
    // Pass 1: moments, and per-chunk sums of squares.
    cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
      double w2c = 0, d2c = 0;
      Moments::norms(chunk, l, coefficients(chunk), w2c, d2c);
      l.partials[2 * chunk.index] = w2c;
      l.partials[2 * chunk.index + 1] = d2c;
    });
    // Each tensor's chunks (stored in tensor order) added in the CUDA ratio kernel's order.
    for (size_t first = 0, last = 0; first < chunks.size(); first = last) {
      while (last < chunks.size() && chunks[last].tensor == chunks[first].tensor) ++last;
      const int64_t count = static_cast<int64_t>(last - first);
      w2[chunks[first].tensor] = lane_strided_sum(l.partials + 2 * first, count, 2);
      d2[chunks[first].tensor] = lane_strided_sum(l.partials + 2 * first + 1, count, 2);
    }
    if (split.pass == LambPass::first) {
      for (size_t t = 0; t < plan.num_tensors(); ++t) {
        split.sums[2 * static_cast<int64_t>(split.index[t])] = w2[t];
        split.sums[2 * static_cast<int64_t>(split.index[t]) + 1] = d2[t];
      }
      return;
    }
  }
  for (size_t t = 0; t < plan.num_tensors(); ++t) l.ratios[t] = lamb_ratio(w2[t], d2[t], l.groups[plan.groups()[t]]);

  // Pass 2: the weights.
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    const LambCoefficients<C> c = coefficients(chunk);
    const C step_size = exact::mul(c.eta, static_cast<C>(l.ratios[chunk.chunk.tensor]));
    W* w = chunk.tensor<W>(0);
    Moments::update(chunk, l, c, step_size, [&](int i, C w_old, C w_new) {
      if (l.update_list >= 0) chunk.tensor<W>(l.update_list)[i] = cpu::from_compute<W>(w_new - w_old);
      else w[i] = cpu::from_compute<W>(w_new);
      if (l.copy_list >= 0) {
        dispatch_dtype(plan.dtype(l.copy_list), [&]<class Copy>() {
          if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) {
            chunk.tensor<Copy>(l.copy_list)[i] = cpu::from_compute<Copy>(static_cast<float>(w_new));
          }
        });
      }
    });
  });
}

}  // namespace

void lamb_cpu(const MultiTensorPlan& plan, const LambLaunch& l) {
  if (l.do_update != nullptr && !*l.do_update) return;
  if (l.inputs.found_inf != nullptr && *l.inputs.found_inf) return;
  if (!plan.empty()) {
    if (plan.dtype(0) == DType::f64) {
      run<PlainMoments<double, double, double>>(plan, l);
    } else {
      dispatch_dtype(plan.dtype(1), [&]<class G>() {
        if constexpr (!std::is_same_v<G, double>) {
          if (l.absmax_list >= 0) return run<BlockwiseMoments<G>>(plan, l);
        }
        dispatch_dtype(plan.dtype(2), [&]<class M>() {
          if constexpr (!std::is_same_v<G, double> && (std::is_same_v<M, float> || std::is_same_v<M, bfloat16>)) {
            run<PlainMoments<float, G, M>>(plan, l);
          }
        });
      });
    }
  }
  if (l.inputs.step_device != nullptr && l.inputs.split.pass != LambPass::first) ++*l.inputs.step_device;
}

}  // namespace gradkit::backend
