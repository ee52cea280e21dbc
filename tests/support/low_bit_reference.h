// A float64 reference of 8-bit blockwise quantization, written from the
// paper's definition (Dettmers et al. 2022, with the dynamic map of Dettmers
// 2016), independent of the library: the code tables in closed form, the
// nearest code by exhaustive search, the absmax of each block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace gradkit::test {

// The dynamic map: for the decimal exponents 10^-6 .. 10^0 in turn, 2^k
// (signed) or 2^(k+1) (unsigned) equal fraction steps of [0.1, 1] for the
// k-th exponent, each step's centre; the signed map takes each with both
// signs; then 0 and 1. Ascending.
inline std::vector<double> reference_code(bool is_signed) {
  std::vector<double> code = {0.0, 1.0};
  for (int k = 0; k <= 6; ++k) {
    const int steps = is_signed ? 1 << k : 2 << k;
    for (int j = 0; j < steps; ++j) {
      const double centre = std::pow(10.0, k - 6) * (0.1 + 0.9 * (j + 0.5) / steps);
      code.push_back(centre);
      if (is_signed) code.push_back(-centre);
    }
  }
  std::sort(code.begin(), code.end());
  return code;
}

// The 4-bit maps (Li et al. 2023), ascending: the signed dynamic map with 3
// decimal exponents (10^-2 .. 10^0, 2^k steps for the k-th, both signs,
// then 0 and 1); and the unsigned one without zero, "DE-0" (2^(k+1) steps
// for the k-th, then 1, and the smallest centre twice where 0 would be).
inline std::vector<double> reference_code4(bool is_signed) {
  std::vector<double> code = {1.0};
  if (is_signed) code.push_back(0.0);
  for (int k = 0; k <= 2; ++k) {
    const int steps = is_signed ? 1 << k : 2 << k;
    for (int j = 0; j < steps; ++j) {
      const double centre = std::pow(10.0, k - 2) * (0.1 + 0.9 * (j + 0.5) / steps);
      code.push_back(centre);
      if (is_signed) code.push_back(-centre);
    }
  }
  std::sort(code.begin(), code.end());
  if (!is_signed) code.insert(code.begin(), code.front());
  return code;
}

// The index of the code nearest to x; the distance to it and to the second
// nearest (to tell a near-tie, where f32 rounding may pick either).
struct Nearest {
  int index;
  double distance, runner_up;
};

// `positive_floor`: the unsigned map's rule that a positive value never
// takes the code 0 (the value 0) but at least the smallest positive code
// (docs/ops.md); then the code is exact, no near-tie. Of two codes with one
// value (the 4-bit DE-0 map's 0 and 1) the higher is taken, as the kernels
// take it for every x above that value.
inline Nearest nearest_code(const std::vector<double>& code, double x, bool positive_floor = false) {
  Nearest n{0, INFINITY, INFINITY};
  for (int i = 0; i < static_cast<int>(code.size()); ++i) {
    const double d = std::abs(code[i] - x);
    if (i > 0 && code[i] == code[n.index] && d == n.distance) {
      n.index = i;
    } else if (d < n.distance) {
      n.runner_up = n.distance;
      n = {i, d, n.runner_up};
    } else if (d < n.runner_up) {
      n.runner_up = d;
    }
  }
  if (positive_floor && x > 0 && code[n.index] == 0) return {n.index + 1, std::abs(code[n.index + 1] - x), INFINITY};
  return n;
}

inline double block_absmax(const std::vector<double>& x, size_t begin, size_t end) {
  double m = 0;
  for (size_t i = begin; i < end; ++i) m = std::max(m, std::abs(x[i]));
  return m;
}

}  // namespace gradkit::test
