// What the whole-tensor state conversions (quantize_blockwise, split_masters
// and their inverses) share: each argument's checks, naming it, and the copy
// of a tensor to host memory (they compute on the host, for any device).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"

namespace gradkit::ops {

// Throws naming `arg` unless `t` has `dtype`, `numel` elements, lies on
// `device` and is not null.
inline void check_staged(std::string_view op, std::string_view arg, const TensorView& t, DType dtype, int64_t numel,
                         Device device) {
  if (t.dtype != dtype) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, arg,
                         "has dtype " + std::string(dtype_name(t.dtype)) + ", expected " + std::string(dtype_name(dtype)));
  }
  if (t.numel != numel || t.numel < 0) {
    throw_argument_error(ErrorCode::size_mismatch, op, arg,
                         "has " + std::to_string(t.numel) + " elements, expected " + std::to_string(numel));
  }
  if (t.device != device) {
    throw_argument_error(ErrorCode::device_mismatch, op, arg,
                         "is on " + to_string(t.device) + ", expected " + to_string(device));
  }
  if (t.numel > 0 && t.data == nullptr) {
    throw_argument_error(ErrorCode::null_pointer, op, arg, "is null; expected a valid pointer");
  }
}

template <class T>
std::vector<T> to_host(const TensorView& t) {
  std::vector<T> out(static_cast<size_t>(t.numel));
  copy_to_host(out.data(), t.data, t.bytes(), t.device);
  return out;
}

}  // namespace gradkit::ops
