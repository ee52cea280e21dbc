// Element types and the one place where a runtime dtype becomes a C++ type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gradkit/core/half.h"

namespace gradkit {

enum class DType : uint8_t { f32, f16, bf16, f64 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
  }
  return "?";
}

// Maps a C++ element type to its DType.
template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

// A (buffer, value) element-type pair, as the mixed-precision ops take them.
struct DTypePair {
  DType first;
  DType second;
  friend constexpr bool operator==(DTypePair, DTypePair) = default;
};

// Calls fn.template operator()<T>() with the C++ type of `t`.
// The host-side types are float, gradkit::half, gradkit::bfloat16, double;
// backends map them to their own (the CUDA backend to __half, __nv_bfloat16).
template <class Fn>
decltype(auto) dispatch_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::f32: return fn.template operator()<float>();
    case DType::f16: return fn.template operator()<half>();
    case DType::bf16: return fn.template operator()<bfloat16>();
    case DType::f64: break;
  }
  return fn.template operator()<double>();
}

// Dispatches on a pair; each pair is instantiated only if it is listed in `Pairs`.
template <class Fn>
decltype(auto) dispatch_dtype_pair(DTypePair p, Fn&& fn) {
  return dispatch_dtype(p.first, [&]<class A>() {
    return dispatch_dtype(p.second, [&]<class B>() { return fn.template operator()<A, B>(); });
  });
}

}  // namespace gradkit
