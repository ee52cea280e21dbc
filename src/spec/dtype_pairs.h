// The one table of (buffer, value) dtype pairs the accumulate ops take, as a
// compile-time predicate for the backends' dispatch and as a runtime list.
#pragma once

#include <type_traits>

#include "gradkit/core/dtype.h"

namespace gradkit::spec {

template <class T>
inline constexpr bool is_16_or_32_bit_float =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

template <class Buffer, class Value>
inline constexpr bool is_accumulate_pair_v =
    (is_16_or_32_bit_float<Buffer> && is_16_or_32_bit_float<Value>) ||
    (std::is_same_v<Buffer, double> && std::is_same_v<Value, double>);

}  // namespace gradkit::spec
