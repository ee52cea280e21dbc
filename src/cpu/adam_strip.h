// The Adam update over a strip of elements in the compute type, one vector
// loop per combination of the launch's flags (backend/adam_math.h's
// AdamFlags), so that no per-element branch stays in the loop; the
// combination is picked once per chunk (adam_strip_function).
#pragma once

#include "backend/adam_math.h"
#include "cpu/vector_loop.h"

namespace gradkit::cpu {

template <class C>
using AdamStripFunction = void (*)(C* w, const C* g, C* m, C* v, C* vmax, int n,
                                   const backend::AdamCoefficients<C>& c, C scale);

// w, m, v (and vmax with amsgrad; unused otherwise) updated from the
// gradient g, divided by `scale` first when Scaled (as the CUDA kernel does:
// src/cuda/adam.cu). The strips never overlap (plans reject overlapping
// tensors, and buffers are the chunk's own).
template <class C, class Flags, bool Scaled>
GRADKIT_CPU_CLONES void adam_strip(C* __restrict w, const C* __restrict g, C* __restrict m, C* __restrict v,
                                   C* __restrict vmax, int n, const backend::AdamCoefficients<C>& c, C scale) {
  const backend::AdamCoefficients<C> k = c;  // a local copy: its fields cannot alias the strips
  for (int i = 0; i < n; ++i) {
    const C gi = Scaled ? g[i] / scale : g[i];
    C unused = 0;
    C& vmaxi = Flags::amsgrad ? vmax[i] : unused;
    backend::adam_element(w[i], gi, m[i], v[i], vmaxi, k, Flags{});
  }
}

// The strip loop for the chunk's flags and the launch's scaling.
template <class C>
AdamStripFunction<C> adam_strip_function(const backend::AdamCoefficients<C>& c, bool scaled) {
  using backend::AdamFlags;
  auto with_scaled = [&]<class Flags>() -> AdamStripFunction<C> {
    return scaled ? &adam_strip<C, Flags, true> : &adam_strip<C, Flags, false>;
  };
  auto with_maximize = [&]<WeightDecay D, bool A>() -> AdamStripFunction<C> {
    return c.maximize ? with_scaled.template operator()<AdamFlags<D, A, true>>()
                      : with_scaled.template operator()<AdamFlags<D, A, false>>();
  };
  auto with_amsgrad = [&]<WeightDecay D>() -> AdamStripFunction<C> {
    return c.amsgrad ? with_maximize.template operator()<D, true>() : with_maximize.template operator()<D, false>();
  };
  switch (static_cast<WeightDecay>(c.decay)) {
    case WeightDecay::l2: return with_amsgrad.template operator()<WeightDecay::l2>();
    case WeightDecay::decoupled: return with_amsgrad.template operator()<WeightDecay::decoupled>();
    case WeightDecay::hugging_face: break;
  }
  return with_amsgrad.template operator()<WeightDecay::hugging_face>();
}

}  // namespace gradkit::cpu
