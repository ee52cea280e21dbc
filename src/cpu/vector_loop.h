// What the CPU backend's hot loops need to vectorize, and where they run.
//
// GRADKIT_CPU_CLONES compiles a function three times (AVX-512F, AVX2 and the
// baseline x86-64) and picks one when the library is loaded (GCC's
// target_clones: an ifunc resolver reading the CPU's features), so one
// binary uses the widest vectors the machine has and still runs on any
// x86-64. The loops it marks are plain C++ that GCC's auto-vectorizer turns
// into vector loops (docs/cpu-kernels.md shows its report). That keeps CPU =
// CUDA bit for bit: a vector add, multiply, divide or square root rounds each
// lane exactly as the scalar instruction does, and the library is compiled
// with -ffp-contract=off, so no clone fuses a multiply-add (src/CMakeLists.txt).
#pragma once

#include <type_traits>

#include "cpu/types.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRADKIT_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GRADKIT_CPU_CLONES
#endif

namespace gradkit::cpu {

// One element from From to To: into the compute type (f32, f64) exactly, or
// out of it rounded once to nearest even (types.h).
template <class To, class From>
inline To convert_element(From x) {
  if constexpr (std::is_same_v<To, float> || std::is_same_v<To, double>) return to_compute<To>(x);
  else return from_compute<To>(x);
}

// out[k] = in[k] converted, for k < n: a vector loop with each clone.
template <class From, class To>
GRADKIT_CPU_CLONES void convert_strip(const From* __restrict in, To* __restrict out, int n) {
  for (int k = 0; k < n; ++k) out[k] = convert_element<To>(in[k]);
}

// The compute-type view of n elements of a tensor at `data`: the tensor
// itself when it holds C already, else `buffer`, filled by conversion.
template <class C, class T>
auto load_strip(T* data, C* buffer, int n) -> std::conditional_t<std::is_const_v<T>, const C*, C*> {
  if constexpr (std::is_same_v<std::remove_const_t<T>, C>) {
    (void)buffer;
    (void)n;
    return data;
  } else {
    convert_strip(data, buffer, n);
    return buffer;
  }
}

// Writes a strip that load_strip gave back into the tensor: nothing to do
// when the strip was the tensor itself.
template <class C, class T>
void store_strip(const C* values, T* data, int n) {
  if constexpr (!std::is_same_v<T, C>) convert_strip(values, data, n);
  else {
    (void)values;
    (void)data;
    (void)n;
  }
}

}  // namespace gradkit::cpu
