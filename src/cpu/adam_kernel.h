// What the CPU Adam kernels share: how weights are stored, the optional
// model copy, the per-launch values and the compile-time mode. The element
// loops (adam.cc, adam_low_bit.h) are templates on all of these, so that no
// per-launch choice is left inside them and GCC vectorizes them (isa.h).
#pragma once

#include <cstdint>
#include <type_traits>

#include "spec/adam.h"
#include "spec/adam_math.h"
#include "cpu/isa.h"
#include "cpu/master_weights.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::spec {
namespace cpu_adam {

using namespace cpu_master;  // the weights, remainders and model copy of every CPU optimizer kernel

// The launch's per-step values: the gradient scale and the step count
// (device scalars are host memory on the CPU).
template <class C>
struct StepValues {
  C scale;
  C inverse_scale;  // 1 / scale, for the low-bit form (unscaled_by_reciprocal)
  bool scaled;  // scale != 1
  int64_t step;
  explicit StepValues(const AdamStepInputs& in)
      : scale(static_cast<C>(in.grad_scale_device != nullptr ? *in.grad_scale_device : in.grad_scale)),
        inverse_scale(C(1) / scale),
        scaled(scale != C(1)),
        step(in.step_device != nullptr ? *in.step_device : in.step) {}

  AdamCoefficients<C> coefficients(const MultiTensorPlan& plan, const AdamLaunch& launch, const PlanChunk& chunk) const {
    const int group = plan.groups()[chunk.tensor];
    const AdamHyperparameters& h = launch.groups[group];
    const double lr = launch.inputs.lr_device != nullptr ? launch.inputs.lr_device[group] : h.lr;
    return adam_coefficients<C>(h, lr, step);
  }
};

// The gradient divided by the scale, unless the scale is 1, as the CUDA
// kernel does. Not "always divide": g / 1 is g, but the compiler may then
// fold maximize's negation into the division (g / -1), which gives a NaN
// gradient the other sign. The choice is a template parameter: the kernels
// pick the loop once per chunk (with_scaling), so no element loop carries
// it. (A select on a loop-invariant bool is unswitched by GCC only while the
// loop is small; maximize with 16-bit gradients is past that size, and its
// loops would keep a branch and not vectorize.)
template <bool Scaled, class C, class G>
inline C unscaled(G g, C scale) {
  const C x = cpu::to_compute<C>(g);
  if constexpr (Scaled) return x / scale;
  else return x;
}

// The low-bit form's (AdamForm::folded) unscaled gradient: times the
// scale's reciprocal, one division per launch instead of one per element,
// as the CUDA 8-bit kernel does.
template <bool Scaled, class C, class G>
inline C unscaled_by_reciprocal(G g, C inverse_scale) {
  const C x = cpu::to_compute<C>(g);
  if constexpr (Scaled) return x * inverse_scale;
  else return x;
}

// Calls f.template operator()<true or false>() as `scaled` says.
template <class F>
void with_scaling(bool scaled, const F& f) {
  if (scaled) f.template operator()<true>();
  else f.template operator()<false>();
}

// Calls f.template operator()<Mode>() with the group's choices as an
// AdamFlags (12 instances per kernel).
template <class C, class F>
void with_mode(const AdamCoefficients<C>& c, const F& f) {
  auto with_decay = [&]<WeightDecay D>() {
    if (c.amsgrad) {
      if (c.maximize) f.template operator()<AdamFlags<D, true, true>>();
      else f.template operator()<AdamFlags<D, true, false>>();
    } else {
      if (c.maximize) f.template operator()<AdamFlags<D, false, true>>();
      else f.template operator()<AdamFlags<D, false, false>>();
    }
  };
  switch (static_cast<WeightDecay>(c.decay)) {
    case WeightDecay::l2: return with_decay.template operator()<WeightDecay::l2>();
    case WeightDecay::decoupled: return with_decay.template operator()<WeightDecay::decoupled>();
    case WeightDecay::hugging_face: return with_decay.template operator()<WeightDecay::hugging_face>();
  }
}

}  // namespace cpu_adam

// 8-bit moments (launch.absmax_list >= 0): adam_low_bit.cc.
void adam_int8_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa);
// 4-bit moments (launch.moment_bits == 4): adam_low_bit.cc, the same loop (adam_low_bit.h).
void adam_int4_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa);

}  // namespace gradkit::spec
