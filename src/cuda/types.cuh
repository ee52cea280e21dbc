// Host element types as CUDA sees them, and the two conversions every kernel uses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gradkit/core/half.h"

namespace gradkit::cuda {

template <class T> struct native_type { using type = T; };
template <> struct native_type<half> { using type = __half; };
template <> struct native_type<bfloat16> { using type = __nv_bfloat16; };
template <class T> using native_t = typename native_type<T>::type;

// The type arithmetic is done in: f32, or f64 for f64 data.
template <class T> struct compute_type { using type = float; };
template <> struct compute_type<double> { using type = double; };
template <class T> using compute_t = typename compute_type<T>::type;

template <class C> __device__ __forceinline__ C to_compute(float x) { return x; }
template <class C> __device__ __forceinline__ C to_compute(double x) { return static_cast<C>(x); }
template <class C> __device__ __forceinline__ C to_compute(__half x) { return __half2float(x); }
template <class C> __device__ __forceinline__ C to_compute(__nv_bfloat16 x) { return __bfloat162float(x); }

// Rounds once, to nearest even.
template <class T> __device__ __forceinline__ T from_compute(float x);
template <> __device__ __forceinline__ float from_compute<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_compute<double>(float x) { return x; }
template <> __device__ __forceinline__ __half from_compute<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_compute<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <class T> __device__ __forceinline__ T from_compute(double x) { return static_cast<T>(x); }

}  // namespace gradkit::cuda
