// Element conversions for the CPU backend: the host twins of src/cuda/types.cuh.
#pragma once

#include "gradkit/core/half.h"

namespace gradkit::cpu {

template <class T> struct compute_type { using type = float; };
template <> struct compute_type<double> { using type = double; };
template <class T> using compute_t = typename compute_type<T>::type;

template <class C> inline C to_compute(float x) { return x; }
template <class C> inline C to_compute(double x) { return static_cast<C>(x); }
template <class C> inline C to_compute(half x) { return static_cast<float>(x); }
template <class C> inline C to_compute(bfloat16 x) { return static_cast<float>(x); }

// Rounds once, to nearest even.
template <class T> inline T from_compute(float x) { return T(x); }
template <class T> inline T from_compute(double x) { return static_cast<T>(x); }

}  // namespace gradkit::cpu
