// Float64 references for the gradient-control ops, written from docs/ops.md
// and independent of the library's code paths.
#pragma once

#include <vector>

namespace gradkit::test {

inline std::vector<double> reference_accumulate(const std::vector<double>& buffer,
                                                const std::vector<double>& value, bool overwrite) {
  std::vector<double> out(buffer.size());
  for (size_t i = 0; i < buffer.size(); ++i) out[i] = overwrite ? value[i] : buffer[i] + value[i];
  return out;
}

}  // namespace gradkit::test
