// The encode and decode of 8-bit blockwise moments (include/gradkit/ops/
// blockwise.h), written once and compiled for both backends, so that the CPU
// and CUDA kernels store the same byte for the same value.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "backend/exact_math.h"
#include "backend/master_math.h"  // float_bits
#include "gradkit/ops/blockwise.h"

namespace gradkit::backend {

// Where a value's search starts: |x| in [0, 4) is cut into buckets by its
// f32 bit pattern (its exponent and the top MantissaBits of its fraction;
// every |x| below 2^-(Exponents - 2) falls in bucket 0), one set for each
// sign, and each bucket keeps the number of decision points below its
// lowest value (a table's `start`). Within a bucket at most kQuantSpan
// decision points lie (checked when the tables are built), so kQuantSpan
// comparisons finish the count that the binary search (count_below) gives:
// the same code for every x, in 2 table reads instead of log2(codes). Each
// form picks the fewest buckets that keep its decision points apart (the
// 8-bit maps' 7 fraction bits over 26 exponents; the 4-bit maps',
// blockwise4_math.h, 3 over 12).
inline constexpr int kQuantSpan = 1;
template <int MantissaBits, int Exponents>
struct QuantBuckets {
  static constexpr int kMantissaBits = MantissaBits;
  static constexpr int kCount = Exponents << MantissaBits;  // per sign
  static constexpr uint32_t kLowestBits = static_cast<uint32_t>(127 - (Exponents - 2)) << 23;
  static constexpr int kShift = 23 - MantissaBits;
  // The lowest bucket's pattern has no bits below the shift, so the
  // subtraction can follow the shift (a constant the compiler folds into the
  // table's address).
  static_assert((kLowestBits & ((1u << kShift) - 1)) == 0);
  // The bucket of a magnitude's bit pattern (at most kQuantNanBits).
  static GRADKIT_HD int of(uint32_t magnitude) {
    const uint32_t clamped = magnitude > kLowestBits ? magnitude : kLowestBits;
    return static_cast<int>(clamped >> kShift) - static_cast<int>(kLowestBits >> kShift);
  }
};
using Quant8Buckets = QuantBuckets<7, 26>;  // 2^-24 .. 2^1
inline constexpr int kQuantMantissaBits = Quant8Buckets::kMantissaBits;
inline constexpr int kQuantBuckets = Quant8Buckets::kCount;
inline constexpr uint32_t kQuantLowestBits = Quant8Buckets::kLowestBits;
// The bucket every NaN falls in (the encodes clamp magnitudes to 2.0's
// bits; no finite x reaches 2, since |value| <= absmax): its start is 0 for
// both signs, and a comparison with NaN is false, so a NaN encodes as 0
// without a rule of its own.
inline constexpr uint32_t kQuantNanBits = 0x40000000u;  // 2.0f

// One code table: the 256 codes, ascending, the 255 decision points
// between neighbours (midpoints[i] between codes i and i + 1, the f64
// midpoint rounded to f32 once, on the host), and the buckets' starts
// (positive x, then negative x), which the CPU backend's encode reads
// (bucketed_count).
//
// The unsigned map's first decision point is 0, not the midpoint of its
// codes 0 and 1: a positive exp_avg_sq value never encodes as 0 (docs/ops.md),
// and counting the decision points below x with that one at 0 is exactly
// "the nearest code, then at least code 1 for a positive x". The floor is
// thus part of the table, and costs the encode nothing.
struct QuantTable {
  using Buckets = Quant8Buckets;
  float codes[256];
  float midpoints[256];  // 255 used; the last is +Inf, never passed
  uint8_t start[2 * Buckets::kCount];
};

// The CUDA kernels' encode starts from a line per binade instead of a bucket
// (count_from_lines, below): rows 0 .. 24 for |x| in [2^-24, 2) (row 0 from
// 0), row 25 for |x| >= 2 and NaN, padded to 32 so that a warp's reads of
// one of its arrays never meet in a shared-memory bank.
inline constexpr int kQuantLineRows = 32;
inline constexpr int kQuantLastLineRow = 25;
inline constexpr uint32_t kQuantLineLowestBits = Quant8Buckets::kLowestBits;  // 2^-24
struct QuantLines {
  float slope[kQuantLineRows];
  float intercept[kQuantLineRows];
};

// Both tables, exp_avg's (signed) then exp_avg_sq's (unsigned), then their
// lines: after the tables, so that a kernel built before the lines reads the
// same bytes as its tables (scripts/kernel_variant.py times other
// revisions' kernels in one library).
struct QuantTables {
  QuantTable table[2];
  QuantLines lines[2];
};

// One table as the CUDA kernels keep it in shared memory: the codes, the
// decision points and the lines, without the buckets' 6.5 KB of starts (a
// warp's reads of them met in the banks 3.2 times, bench/RESULTS.md,
// 2026-11-28).
struct QuantCodeTable {
  float codes[256];
  float midpoints[256];
  QuantLines lines;
};
struct QuantCodeTables {
  QuantCodeTable table[2];
};

// A table with its lines, as the CUDA kernels copy it (the host's checks
// of the lines use it too).
inline QuantCodeTable code_table(const QuantTable& t, const QuantLines& lines) {
  QuantCodeTable c{};
  for (int i = 0; i < 256; ++i) c.codes[i] = t.codes[i], c.midpoints[i] = t.midpoints[i];
  c.lines = lines;
  return c;
}
inline QuantCodeTable code_table(const QuantTables& t, int moment) { return code_table(t.table[moment], t.lines[moment]); }

// A block's absolute maximum, folded one value at a time on the bit
// patterns with the sign cleared, whose integer order is the order of the
// magnitudes, with every NaN above +Inf: a NaN anywhere makes the absmax a
// NaN (a float max would drop it), so a non-finite moment is not hidden by
// its block's encoding. Integer max does not depend on the order, so any
// reduction tree gives the same bits. Two integer operations per value.
GRADKIT_HD uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7fffffffu; }
GRADKIT_HD uint32_t absmax_bits_fold(uint32_t absmax_bits, uint32_t magnitude) {
  return magnitude > absmax_bits ? magnitude : absmax_bits;
}
GRADKIT_HD float absmax_fold(float absmax, float x) {
  return bits_float(absmax_bits_fold(magnitude_bits(absmax), magnitude_bits(x)));
}

// The multiplier that maps a block onto [-1, 1]: 1 / absmax, or 0 for an
// all-zero block (every value then encodes as the code 0). An Inf absmax
// gives 0 too, a NaN absmax NaN: the block decodes to Inf/NaN either way.
GRADKIT_HD float quant_scale(float absmax) { return absmax == 0.0f ? 0.0f : 1.0f / absmax; }

// The index of the code nearest to x (x already scaled into [-1, 1]): the
// count of decision points below x among the N - 1 of an N-entry table
// (midpoints[N - 1] is +Inf), by a branch-free binary search of log2(N)
// steps. A value exactly on a decision point takes the lower code; NaN
// gives 0. The definition of both forms' encodes: bucketed_count gives the
// same count without a search.
template <int N>
GRADKIT_HD uint8_t count_below(const float (&midpoints)[N], float x) {
  static_assert(N >= 2 && (N & (N - 1)) == 0, "a power of two");
  int q = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int step = N / 2; step > 0; step >>= 1) q += x > midpoints[q + step - 1] ? step : 0;
  return static_cast<uint8_t>(q);
}

GRADKIT_HD uint8_t quantize_search(const QuantTable& t, float x) { return count_below(t.midpoints, x); }

// The code of x in a table with bucket starts (QuantTable, QuantTable4):
// count_below's count, from the bucket's start and kQuantSpan comparisons (a
// comparison past the bucket's last decision point is false, so the count
// stops there), without a branch. 1 < |x| < 2 (a rounding of m * (1 /
// absmax) may pass 1): the positive start is N - 1 (every decision point
// lies below 1; midpoints[N - 1] is +Inf), the negative start 0, which is
// the search's count for x > 1 and x < -1. NaN (clamped into the bucket of
// 2.0, whose starts are 0, and greater than nothing) gives 0, as the search
// does. The CPU backend's encode; the CUDA kernels' gives the same count in
// fewer instructions (cuda/blockwise_codecs.cuh, bucketed_count_cuda), and
// like it the count comes back in 32 bits (below N by the table's
// construction).
template <class Table>
GRADKIT_HD uint32_t bucketed_count(const Table& t, float x) {
  using Buckets = typename Table::Buckets;
  const uint32_t bits = float_bits(x);
  uint32_t magnitude = bits & 0x7fffffffu;  // -0 is 0
  magnitude = magnitude < kQuantNanBits ? magnitude : kQuantNanBits;
  int q = t.start[Buckets::of(magnitude) + static_cast<int>(bits >> 31) * Buckets::kCount];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kQuantSpan; ++k) q += x > t.midpoints[q] ? 1 : 0;
  return static_cast<uint32_t>(q);
}

GRADKIT_HD uint8_t quantize(const QuantTable& t, float x) { return static_cast<uint8_t>(bucketed_count(t, x)); }

// The smaller of a and b, or NaN where either is (fminf would return the
// other operand), as PTX's min.NaN.
GRADKIT_HD float min_or_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return a != a || b != b ? std::numeric_limits<float>::quiet_NaN() : (a < b ? a : b);
#endif
}

// The larger of x and 0, or NaN where x is (max.NaN).
GRADKIT_HD float positive_part_or_nan(float x) {
#if defined(__CUDA_ARCH__)
  float d;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(d) : "f"(x));
  return d;
#else
  return x != x || x > 0.0f ? x : 0.0f;
#endif
}

// floor(f) as an int for f in [0, 256], and 0 for NaN (PTX's cvt.rmi.s32.f32).
GRADKIT_HD int floor_or_zero(float f) {
#if defined(__CUDA_ARCH__)
  return __float2int_rd(f);
#else
  return f != f ? 0 : static_cast<int>(std::floor(f));
#endif
}

// The dynamic map's decision points are evenly spaced within each decade
// (ops/blockwise.cc, dynamic_map): decade d, of n_d values over
// (D_d / 10, D_d], has its points at D_d (0.1 + 0.9 j / n_d), and the one
// between it and the next decade lies at D_d (1 + 0.9 / n_d). So the count
// below a positive u follows the line R_d(u) = I_d + (u - D_d) s_d, with
// s_d = n_d / (0.9 D_d) and I_d = z + 2 n_d the index of that last point
// (z = 126 for the signed map, whose positive points come after 127
// negative ones; -2 for the unsigned map), within 0.2 of a point's index
// (at the decade's last point). The next decade's line (n doubles, D
// grows tenfold) is R_{d+1}(u) = 2 c_d - z + u s_d / 5, where c_d = I_d -
// D_d s_d is R_d's intercept. The count is concave in u, so over a binade
// (which meets at most two decades: a decade is 3.3 binades) it is the
// smaller of the two lines; a table keeps each binade's s_d and c_d + 1/2
// (QuantLines; ops/blockwise.cc, fill_lines), and f = min(both
// lines) + 1/2, capped at 254, lies within half a point of the count, so
// floor(f) is the count or one less. Negative x (the signed map, whose
// points below 0 mirror those above it but the last, 254 = 0.9965's): 254 -
// f, which is 0 from u = 0.9859 (no point lies below -0.9859). Row 25
// (|x| >= 2 and NaN) has a NaN slope: f is NaN, and the guess 0 (as the
// buckets' 2.0 start). count_from_lines then compares x with the guess's
// decision point, as bucketed_count does with a bucket's start: the same
// count for every f32 (tests/test_blockwise.cc samples it, tests/
// test_blockwise_codecs.cu checks every f32 on the GPU, and fill_lines
// checks each line at every point where it or the count steps).
template <bool kSigned>
inline constexpr float kQuantLineNextShift = kSigned ? 126.5f : -1.5f;  // z + 1/2
inline constexpr float kQuantLineCap = 254.0f;

// The guess, the count or one less. Unsigned: every x <= 0 counts 0, as 0 does.
template <bool kSigned>
GRADKIT_HD int guess_from_lines(const QuantCodeTable& t, float x) {
  const float u = kSigned ? std::fabs(x) : positive_part_or_nan(x);
  const float clamped = std::fmax(std::fmin(u, 2.0f), bits_float(kQuantLineLowestBits));  // NaN: 2.0
  const int row = static_cast<int>(float_bits(clamped) >> 23) - static_cast<int>(kQuantLineLowestBits >> 23);
  const float s = t.lines.slope[row], c = t.lines.intercept[row];
  const float here = exact::fma(u, s, c);
  const float next = exact::fma(u, exact::mul(0.2f, s), exact::fma(2.0f, c, -kQuantLineNextShift<kSigned>));
  float f = min_or_nan(min_or_nan(here, next), kQuantLineCap);
  if (kSigned && (float_bits(x) >> 31) != 0) f = exact::sub(kQuantLineCap, f);
  return floor_or_zero(f);
}

// bucketed_count's count from the guess: one comparison.
template <bool kSigned>
GRADKIT_HD uint32_t count_from_lines(const QuantCodeTable& t, float x) {
  const int q = guess_from_lines<kSigned>(t, x);
  return static_cast<uint32_t>(q + (x > t.midpoints[q] ? 1 : 0));
}

// q: a code (below 256), in any unsigned width: the CUDA kernels take it
// from a byte of a word as it is, with no narrowing to mask it again.
GRADKIT_HD float dequantize(const QuantTable& t, uint32_t q, float absmax) { return exact::mul(t.codes[q], absmax); }
GRADKIT_HD float dequantize(const QuantCodeTable& t, uint32_t q, float absmax) {
  return exact::mul(t.codes[q], absmax);
}

}  // namespace gradkit::backend
