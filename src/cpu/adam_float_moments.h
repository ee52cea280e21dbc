// The CPU Adam loop over float moments: the same per-element formula as
// the CUDA kernel (spec/adam_math.h), over the plan's chunks, with every
// per-launch choice a template parameter (adam_kernel.h) that GCC vectorizes
// for the instruction set isa.h picks. Its two instances (f32 weights, or
// bf16 weights with remainders) are compiled in two files, adam_plain.cc
// and adam_remainder.cc, so that a build compiles them at once: in one file
// they take minutes of one core.
// adam.cc picks the instance (and runs float64 weights).
#pragma once

#include <type_traits>

#include "cpu/adam_kernel.h"

namespace gradkit::spec::cpu_adam {

// One chunk with moments stored as M (f32, bf16, f64).
template <class Weights, class G, class M, class Copy, class Mode, bool Scaled>
struct Span {
  using C = typename Weights::C;
  using W = typename Weights::Stored;
  static void run(int64_t n, W* __restrict w, int16_t* __restrict r, const G* __restrict g, M* __restrict m,
                  M* __restrict v, M* __restrict vmax, Copy* __restrict copy, AdamCoefficients<C> c, C scale) {
    for (int64_t i = 0; i < n; ++i) {
      C wc = Weights::load(w, r, i);
      C mc = cpu::to_compute<C>(m[i]), vc = cpu::to_compute<C>(v[i]), vmaxc = 0;
      if constexpr (Mode::amsgrad) vmaxc = cpu::to_compute<C>(vmax[i]);
      adam_element(wc, unscaled<Scaled>(g[i], scale), mc, vc, vmaxc, c, Mode{});
      Weights::store(w, r, i, wc);
      m[i] = cpu::from_compute<M>(mc);
      v[i] = cpu::from_compute<M>(vc);
      if constexpr (Mode::amsgrad) vmax[i] = cpu::from_compute<M>(vmaxc);
      store_copy(copy, i, wc);
    }
  }
};

template <class Weights, class G, class M, class Copy>
void run(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  using C = typename Weights::C;
  using W = typename Weights::Stored;
  const StepValues<C> values(launch.inputs);
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    const AdamCoefficients<C> c = values.coefficients(plan, launch, chunk.chunk);
    with_mode(c, [&]<class Mode>() {
      with_scaling(values.scaled, [&]<bool Scaled>() {
        cpu::run_kernel<Span<Weights, G, M, Copy, Mode, Scaled>>(
            isa, int64_t{chunk.chunk.length}, chunk.tensor<W>(0), remainder_of<Weights>(chunk, launch),
            static_cast<const G*>(chunk.tensor<G>(1)), chunk.tensor<M>(2), chunk.tensor<M>(3),
            Mode::amsgrad ? chunk.tensor<M>(launch.max_list) : static_cast<M*>(nullptr), copy_of<Copy>(chunk, launch),
            c, values.scale);
      });
    });
  });
}

template <class Weights, class G, class M>
void run_copy(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  if (launch.copy_list < 0) return run<Weights, G, M, NoCopy>(plan, launch, isa);
  dispatch_dtype(plan.dtype(launch.copy_list), [&]<class Copy>() {
    if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) run<Weights, G, M, Copy>(plan, launch, isa);
  });
}

// The loop for one way of storing weights, over every gradient, moment and
// model copy dtype: two instances, each compiled in a file of its own.
template <class Weights>
void run_weights(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  dispatch_dtype(plan.dtype(1), [&]<class G>() {
    if constexpr (!std::is_same_v<G, double>) {
      dispatch_dtype(plan.dtype(2), [&]<class M>() {
        if constexpr (std::is_same_v<M, float> || std::is_same_v<M, bfloat16>) run_copy<Weights, G, M>(plan, launch, isa);
      });
    }
  });
}

// The instances: declared here with extern, so that a file including this
// header does not compile them; each is compiled by one of adam_{plain,remainder}.cc,
// which write the same line without extern.
#define GRADKIT_CPU_ADAM(WEIGHTS) \
  template void run_weights<WEIGHTS>(const MultiTensorPlan&, const AdamLaunch&, cpu::Isa)
extern GRADKIT_CPU_ADAM(PlainWeights<float>);
extern GRADKIT_CPU_ADAM(RemainderWeights);

}  // namespace gradkit::spec::cpu_adam
