// The average's last step on the host: each element divided by the rank
// count in f32 (f64 for f64) and rounded once, as the CUDA kernel does.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gradkit/core/dtype.h"

namespace gradkit::comm {

inline void divide_on_host(void* data, int64_t count, DType dtype, int divisor) {
  if (divisor == 1) return;  // x / 1 is x
  dispatch_dtype(dtype, [&]<class T>() {
    auto* p = static_cast<T*>(data);
    if constexpr (std::is_same_v<T, double>) {
      for (int64_t i = 0; i < count; ++i) p[i] = p[i] / static_cast<double>(divisor);
    } else {
      for (int64_t i = 0; i < count; ++i) p[i] = T(static_cast<float>(p[i]) / static_cast<float>(divisor));
    }
  });
}

}  // namespace gradkit::comm
