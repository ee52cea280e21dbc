// LAMB on the CPU: the same two passes and the same per-element formulas as
// the CUDA backend (spec/lamb.h, spec/lamb_math.h), and each tensor's
// chunk sums added in the CUDA ratio kernel's order. The element loops of
// float moments are templates on their dtypes and choices (the weights plain
// or completed by their remainders: cpu/master_weights.h), run in the copy
// for the active instruction set (isa.h); 8- or 4-bit moments: cpu/lamb_low_bit.h.
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "spec/lamb.h"
#include "spec/lamb_low_bit.h"
#include "spec/lamb_math.h"
#include "spec/master_math.h"  // bits_as
#include "cpu/isa.h"
#include "cpu/lamb_low_bit.h"
#include "cpu/master_weights.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::spec {
namespace {

using namespace cpu_master;  // the weights, remainders and model copy (shared with Adam)

// x where `keep`, else +0: a select on the bits. (GCC 12 does not vectorize a
// loop in which a float select feeds a conversion to double: it leaves a
// branch; an integer mask it does vectorize.)
template <class C>
inline C kept_or_zero(C x, bool keep) {
  using Bits = std::conditional_t<sizeof(C) == 4, uint32_t, uint64_t>;
  const Bits mask = Bits{0} - static_cast<Bits>(keep);
  return bits_as<C>(bits_as<Bits>(x) & mask);
}

// a where `keep`, else b, for values as stored: a bf16/f16 select taken on
// the bits (GCC leaves a select between two such structs a branch, and the
// loop scalar).
template <class M>
inline M stored_if(bool keep, M a, M b) {
  if constexpr (std::is_same_v<M, bfloat16> || std::is_same_v<M, half>) return M::from_bits(keep ? a.bits : b.bits);
  else return keep ? a : b;
}

// Pass 1 over one chunk: new moments, and the chunk's sums of w^2 and d^2.
// The element work runs as vector loops over blocks of kBlock, leaving each
// element's squares in small buffers; the sums then add them in element
// order (an element whose d is not finite adds +0 to d^2, which leaves the
// sum as it was: it starts at +0 and only grows).
template <class Weights, class G, class M>
struct Pass1 {
  using C = typename Weights::C;
  using W = typename Weights::Stored;
  static constexpr int kBlock = 512;
  static void run(int64_t n, const W* __restrict w, const int16_t* __restrict r, const G* __restrict g,
                  M* __restrict m, M* __restrict v, LambCoefficients<C> c, double* sums) {
    double w2 = 0, d2 = 0;
    alignas(64) double w_squares[kBlock], d_squares[kBlock];
    for (int64_t base = 0; base < n; base += kBlock) {
      const int count = static_cast<int>(n - base < kBlock ? n - base : kBlock);
      for (int k = 0; k < count; ++k) {
        const int64_t i = base + k;
        const C wc = Weights::load(w, r, i);
        const M m_old = m[i], v_old = v[i];
        C mc = cpu::to_compute<C>(m_old), vc = cpu::to_compute<C>(v_old);
        lamb_moments(cpu::to_compute<C>(g[i]), mc, vc, c);
        const M m_stored = cpu::from_compute<M>(mc), v_stored = cpu::from_compute<M>(vc);
        const C d = lamb_direction(wc, cpu::to_compute<C>(m_stored), cpu::to_compute<C>(v_stored), c);
        const bool ok = finite(d);
        m[i] = stored_if(ok, m_stored, m_old);
        v[i] = stored_if(ok, v_stored, cpu::from_compute<M>(-cpu::to_compute<C>(v_old)));  // mark (see spec/lamb.h)
        const C d_kept = kept_or_zero(d, ok);
        d_squares[k] = static_cast<double>(d_kept) * d_kept;
        w_squares[k] = static_cast<double>(wc) * wc;
      }
      for (int k = 0; k < count; ++k) {
        w2 += w_squares[k];
        d2 += d_squares[k];
      }
    }
    sums[0] = w2;
    sums[1] = d2;
  }
};

// Pass 2 over one chunk: the weights (or their update), the model copy, and
// the marks cleared. (No update list or copy with remainder weights.)
template <class Weights, class M, class Copy, bool Update>
struct Pass2 {
  using C = typename Weights::C;
  using W = typename Weights::Stored;
  static void run(int64_t n, W* __restrict w, int16_t* __restrict r, W* __restrict update, const M* __restrict m,
                  M* __restrict v, Copy* __restrict copy, LambCoefficients<C> c, C step_size) {
    for (int64_t i = 0; i < n; ++i) {
      const C w_old = Weights::load(w, r, i);
      const C vc = cpu::to_compute<C>(v[i]);
      const bool marked = std::signbit(vc);
      if (marked) v[i] = cpu::from_compute<M>(-vc);  // a masked store where the ISA has one: no bytes for the rest
      const C updated = lamb_apply(w_old, step_size, lamb_direction(w_old, cpu::to_compute<C>(m[i]), vc, c));
      const C w_new = !marked && finite(updated) ? updated : w_old;
      if constexpr (Update) update[i] = cpu::from_compute<W>(w_new - w_old);
      else Weights::store(w, r, i, w_new);
      store_copy(copy, i, w_new);
    }
  }
};

// Float moments stored as M (f32, bf16; f64 with f64 weights) beside
// Weights (plain f32 or f64, or bf16 with remainders), both passes in the
// active instruction set's copy.
template <class Weights, class G, class M>
struct PlainMoments {
  using C = typename Weights::C;
  using W = typename Weights::Stored;

  static void norms(const cpu::ChunkView& chunk, const LambLaunch& l, const LambCoefficients<C>& c, double* sums,
                    cpu::Isa isa) {
    cpu::run_kernel<Pass1<Weights, G, M>>(isa, int64_t{chunk.chunk.length}, static_cast<const W*>(chunk.tensor<W>(0)),
                                          static_cast<const int16_t*>(remainder_of<Weights>(chunk, l)),
                                          static_cast<const G*>(chunk.tensor<G>(1)), chunk.tensor<M>(2),
                                          chunk.tensor<M>(3), c, sums);
  }

  template <class Copy, bool Update>
  static void update(const cpu::ChunkView& chunk, const LambLaunch& l, const LambCoefficients<C>& c, C step_size,
                     cpu::Isa isa) {
    cpu::run_kernel<Pass2<Weights, M, Copy, Update>>(
        isa, int64_t{chunk.chunk.length}, chunk.tensor<W>(0), remainder_of<Weights>(chunk, l),
        Update ? chunk.tensor<W>(l.update_list) : static_cast<W*>(nullptr), static_cast<const M*>(chunk.tensor<M>(2)),
        chunk.tensor<M>(3), copy_of<Copy>(chunk, l), c, step_size);
  }
};

// Whether a moment storage's weights are bf16 with remainders.
template <class Moments>
constexpr bool kRemainderMoments = false;
template <class G, class M>
constexpr bool kRemainderMoments<PlainMoments<RemainderWeights, G, M>> = true;

template <class Moments>
void run(const MultiTensorPlan& plan, const LambLaunch& l, cpu::Isa isa) {
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
      Moments::norms(chunk, l, coefficients(chunk), &l.partials[2 * chunk.index], isa);
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

  // Pass 2: the weights, with the update list and the copy's type fixed for the launch.
  auto pass2 = [&]<class Copy, bool Update>() {
    cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
      const LambCoefficients<C> c = coefficients(chunk);
      const C step_size = exact::mul(c.eta, static_cast<C>(l.ratios[chunk.chunk.tensor]));
      Moments::template update<Copy, Update>(chunk, l, c, step_size, isa);
    });
  };
  if constexpr (kRemainderMoments<Moments>) {
    return pass2.template operator()<NoCopy, false>();  // neither copy nor update list with remainders
  } else {
    if (l.update_list >= 0) return pass2.template operator()<NoCopy, true>();  // no model copy with an update list
    if (l.copy_list < 0) return pass2.template operator()<NoCopy, false>();
    dispatch_dtype(plan.dtype(l.copy_list), [&]<class Copy>() {
      if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) pass2.template operator()<Copy, false>();
    });
  }
}

}  // namespace

void lamb_cpu(const MultiTensorPlan& plan, const LambLaunch& l) {
  const cpu::Isa isa = cpu::active_isa();  // before anything is written: it may throw
  if (l.do_update != nullptr && !*l.do_update) return;
  if (l.inputs.found_inf != nullptr && *l.inputs.found_inf) return;
  if (!plan.empty()) {
    if (plan.dtype(0) == DType::f64) {
      run<PlainMoments<PlainWeights<double>, double, double>>(plan, l, isa);
    } else {
      dispatch_dtype(plan.dtype(1), [&]<class G>() {
        if constexpr (!std::is_same_v<G, double>) {
          if (l.absmax_list >= 0 && l.moment_bits == 4) return run<LowBitMoments<G, cpu_low_bit::Codec4>>(plan, l, isa);
          if (l.absmax_list >= 0) return run<LowBitMoments<G, cpu_low_bit::Codec8>>(plan, l, isa);
        }
        dispatch_dtype(plan.dtype(2), [&]<class M>() {
          if constexpr (!std::is_same_v<G, double> && (std::is_same_v<M, float> || std::is_same_v<M, bfloat16>)) {
            if (l.remainder_list >= 0) run<PlainMoments<RemainderWeights, G, M>>(plan, l, isa);
            else run<PlainMoments<PlainWeights<float>, G, M>>(plan, l, isa);
          }
        });
      });
    }
  }
  if (l.inputs.step_device != nullptr && l.inputs.split.pass != LambPass::first) ++*l.inputs.step_device;
}

}  // namespace gradkit::spec
