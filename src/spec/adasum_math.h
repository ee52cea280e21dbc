// The coefficients of adasum(a, b) = ca a + cb b for one tensor, from its
// f64 sums, compiled for the host and the device so that both backends use
// one formula: ca = 1 - a·b / (2 |a|²), cb = 1 - a·b / (2 |b|²), and a
// coefficient whose vector's norm is zero is 1 (that vector contributes
// nothing, the other is kept whole). Inf and NaN propagate by IEEE
// arithmetic: a tensor with a non-finite value gets NaN coefficients.
#pragma once

#if defined(__CUDACC__)
#define GRADKIT_ADASUM_HOST_DEVICE __host__ __device__
#else
#define GRADKIT_ADASUM_HOST_DEVICE
#endif

namespace gradkit::comm::adasum {

struct Coefficients {
  double a;
  double b;
};

GRADKIT_ADASUM_HOST_DEVICE inline Coefficients coefficients(double dot, double norm_a, double norm_b) {
  return {norm_a == 0 ? 1.0 : 1.0 - dot / (2.0 * norm_a), norm_b == 0 ? 1.0 : 1.0 - dot / (2.0 * norm_b)};
}

}  // namespace gradkit::comm::adasum
