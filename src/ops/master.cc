// Whole-tensor conversions between f32 masters and (bf16 weight, remainder)
// pairs, with the element formulas the kernels use (backend/master_math.h).
#include "gradkit/ops/master.h"

#include <string>
#include <vector>

#include "backend/master_math.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"

namespace gradkit {
namespace {

void check(std::string_view op, std::string_view arg, const TensorView& t, DType dtype, const TensorView& first) {
  if (t.dtype != dtype) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, arg,
                         "has dtype " + std::string(dtype_name(t.dtype)) + ", expected " + std::string(dtype_name(dtype)));
  }
  if (t.numel != first.numel || t.numel < 0) {
    throw_argument_error(ErrorCode::size_mismatch, op, arg,
                         "has " + std::to_string(t.numel) + " elements, expected " + std::to_string(first.numel));
  }
  if (t.device != first.device) {
    throw_argument_error(ErrorCode::device_mismatch, op, arg,
                         "is on " + to_string(t.device) + ", expected " + to_string(first.device));
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

}  // namespace

void split_masters(const TensorView& masters, const TensorView& weights, const TensorView& remainder) {
  constexpr std::string_view kOp = "split_masters";
  check(kOp, "masters", masters, DType::f32, masters);
  check(kOp, "weights", weights, DType::bf16, masters);
  check(kOp, "remainder", remainder, DType::i16, masters);
  const std::vector<float> m = to_host<float>(masters);
  std::vector<uint16_t> w(m.size());
  std::vector<int16_t> r(m.size());
  for (size_t i = 0; i < m.size(); ++i) backend::split_master(m[i], w[i], r[i]);
  copy_from_host(weights.data, weights.device, w.data(), w.size() * sizeof(uint16_t));
  copy_from_host(remainder.data, remainder.device, r.data(), r.size() * sizeof(int16_t));
}

void join_masters(const TensorView& weights, const TensorView& remainder, const TensorView& masters) {
  constexpr std::string_view kOp = "join_masters";
  check(kOp, "weights", weights, DType::bf16, weights);
  check(kOp, "remainder", remainder, DType::i16, weights);
  check(kOp, "masters", masters, DType::f32, weights);
  const std::vector<uint16_t> w = to_host<uint16_t>(weights);
  const std::vector<int16_t> r = to_host<int16_t>(remainder);
  std::vector<float> m(w.size());
  for (size_t i = 0; i < m.size(); ++i) m[i] = backend::join_master(w[i], r[i]);
  copy_from_host(masters.data, masters.device, m.data(), m.size() * sizeof(float));
}

}  // namespace gradkit
