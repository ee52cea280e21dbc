// The one place that says how close a result must be to the float64
// reference, per output dtype.
//
// An elementwise op here rounds at most twice (once in its f32 arithmetic,
// once to the output type), so each bound is two units of roundoff of the
// output type, relative to the reference, plus the spacing of the output
// type's subnormals for results near zero.
#pragma once

#include <cmath>
#include <vector>

#include "gradkit/core/dtype.h"

namespace gradkit::test {

struct Tolerance {
  double relative;
  double absolute;
};

constexpr Tolerance elementwise_tolerance(DType output) {
  switch (output) {
    case DType::f32: return {0x1p-23, 0x1p-149};
    case DType::f16: return {0x1p-10, 0x1p-24};
    case DType::bf16: return {0x1p-7, 0x1p-133};
    case DType::f64: return {0x1p-52, 0x1p-1074};
  }
  return {0, 0};
}

inline bool within(double got, double want, Tolerance t) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::abs(got - want) <= t.relative * std::abs(want) + t.absolute;
}

}  // namespace gradkit::test

namespace gradkit::test {

// For multi-step optimizer runs compared with the float64 reference: the
// norm-wise relative error ||got - ref|| / ||ref|| allowed after `steps`
// steps, for state stored in `storage`. Each step rounds a few times in the
// compute type and once to storage; the errors add up roughly linearly in
// the worst case.
constexpr double optimizer_tolerance(DType storage, int steps) {
  switch (storage) {
    case DType::f32: return 8 * steps * 0x1p-24;
    case DType::f16: return 4 * steps * 0x1p-11;
    case DType::bf16: return 4 * steps * 0x1p-8;
    case DType::f64: return 8 * steps * 0x1p-53;
  }
  return 0;
}

inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) return INFINITY;
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

}  // namespace gradkit::test

namespace gradkit::test {

// For collectives compared with the float64 sum of every rank's input: the
// engines add the ranks' values in some order, rounding each of the
// ranks - 1 partial sums to `dtype` (f16 and bf16 are added in f32 and
// rounded back, as NCCL does), and an average rounds once more. Each
// rounding is at most one unit of roundoff of a partial sum, and no partial
// sum exceeds the sum of the magnitudes, so the bound is taken relative to
// sum |x_r| (scaled by 1/ranks for an average) rather than to the result,
// which cancellation may make small. One spare rounding covers the order.
struct CollectiveTolerance {
  double per_magnitude;  // times sum |x_r|
  double absolute;
};

constexpr CollectiveTolerance collective_tolerance(DType dtype, int ranks, bool average) {
  const double roundings = ranks + (average ? 1 : 0);
  switch (dtype) {
    case DType::f32: return {roundings * 0x1p-24, roundings * 0x1p-149};
    case DType::f16: return {roundings * 0x1p-11, roundings * 0x1p-24};
    case DType::bf16: return {roundings * 0x1p-8, roundings * 0x1p-133};
    case DType::f64: return {roundings * 0x1p-53, roundings * 0x1p-1074};
    case DType::u8:
    case DType::i16: break;
  }
  return {0, 0};
}

inline bool within_collective(double got, double want, double sum_magnitude, CollectiveTolerance t) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::abs(got - want) <= t.per_magnitude * sum_magnitude + t.absolute;
}

}  // namespace gradkit::test

namespace gradkit::test {

// For Adasum compared with the float64 tree of pairwise combinations: each
// level rounds its two coefficients to the compute type, rounds
// ca·a + cb·b three times in it (two products, a sum) and once more to the
// dtype, and the next level's dot products see the rounded values. Where
// ca·a and cb·b cancel, those roundings are relative to the terms, not to
// the result: the bound is on ||got - want|| per tensor, relative to the
// norm of the terms' magnitudes (|ca| |a| + |cb| |b|, recursively through the
// tree), and the errors add up about linearly with the levels (a
// hierarchical run's sums within a node count as levels too).
constexpr double adasum_tolerance(DType dtype, int levels) {
  switch (dtype) {
    case DType::f32: return 8 * levels * 0x1p-24;
    case DType::f16: return 4 * levels * 0x1p-11;
    case DType::bf16: return 4 * levels * 0x1p-8;
    case DType::f64: return 8 * levels * 0x1p-53;
    case DType::u8:
    case DType::i16: break;
  }
  return 0;
}

// NorMuon's second moment (f32) against the reference's, which takes each
// line's mean square of the reference's result: the results' bf16 units
// (muon_update_tolerance) reach it squared, less the averaging over a line.
constexpr double muon_second_moment_tolerance() { return 2e-2; }

// For Muon's weight update (w_new - w) compared with the float64 reference,
// norm-wise. The Newton-Schulz products run in bf16 with f32 accumulation:
// against the reference that rounds each product to bf16 as they do
// (exact_products false), what differs is the accumulation order, which
// moves an element by one bf16 unit now and then, and ns_steps iterations
// carry it on; against unrounded float64 products, every iteration's bf16
// roundings (2^-9 relative each) add up. Measured on the CPU
// (tests/test_muon.cc, 24x40 to 40x24 matrices, 5 iterations): mostly 0 and
// at most 0.0065 against the rounded reference; 0.0074 to 0.0175 against
// float64 products (what bf16 Newton-Schulz costs; torch's costs the same).
// Per-iteration coefficients (Polar Express's; polar_express) carry one
// bf16 unit further: their first iterations' slopes are up to 8, the fixed
// triple's 3.4. Measured the same way: at most 0.019 against the rounded
// reference, 0.045 to 0.064 against float64 products.
constexpr double muon_update_tolerance(bool exact_products, bool polar_express = false) {
  if (polar_express) return exact_products ? 0x1p-3 : 0x1p-5;
  return exact_products ? 0x1p-5 : 0x1p-6;
}

}  // namespace gradkit::test
