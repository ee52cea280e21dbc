// Element types and the one place where a runtime dtype becomes a C++ type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gradkit/core/half.h"

namespace gradkit {

// f32..f64 are the floating-point element types every op takes. u8 and i16
// are storage types only: the encoded optimizer state (8-bit blockwise
// moments, the 16-bit remainder of an f32 master beside a bf16 weight), which
// only the optimizer updates accept, in the lists that hold such state.
enum class DType : uint8_t { f32, f16, bf16, f64, u8, i16 };

// The floating-point types (not the storage types): what the tests iterate over.
inline constexpr DType kAllDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64};

constexpr bool is_storage_dtype(DType t) { return t == DType::u8 || t == DType::i16; }

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::u8: return 1;
    case DType::i16: return 2;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::u8: return "u8";
    case DType::i16: return "i16";
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

// Calls fn.template operator()<T>() with the C++ type of `t`, one of the
// floating-point types (callers have refused the storage types by then).
// The host-side types are float, gradkit::half, gradkit::bfloat16, double;
// backends map them to their own (the CUDA backend to __half, __nv_bfloat16).
template <class Fn>
decltype(auto) dispatch_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::f32: return fn.template operator()<float>();
    case DType::f16: return fn.template operator()<half>();
    case DType::bf16: return fn.template operator()<bfloat16>();
    case DType::f64:
    case DType::u8:
    case DType::i16: break;
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
