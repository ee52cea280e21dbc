#include "tensors.h"

#include <optional>

#include "gradkit/core/error.h"

namespace gradkit::python {
namespace {

constexpr std::string_view kOp = "gradkit";

DType to_dtype(nb::dlpack::dtype t, const std::string& arg) {
  using nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == static_cast<uint8_t>(dtype_code::Float)) {
      if (t.bits == 32) return DType::f32;
      if (t.bits == 16) return DType::f16;
      if (t.bits == 64) return DType::f64;
    }
    if (t.code == static_cast<uint8_t>(dtype_code::Bfloat) && t.bits == 16) return DType::bf16;
  }
  throw_argument_error(ErrorCode::dtype_unsupported, kOp, arg,
                       "has DLPack dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
                           " bits), expected float32, float16, bfloat16 or float64");
}

bool is_bool(nb::dlpack::dtype t) { return t == nb::dtype<bool>(); }

Device to_device(const Array& a, const std::string& arg) {
  switch (a.device_type()) {
    case nb::device::cpu::value: return Device::cpu();
    case nb::device::cuda::value: return Device::cuda(a.device_id());
    default: break;
  }
  throw_argument_error(ErrorCode::device_mismatch, kOp, arg,
                       "is on DLPack device type " + std::to_string(a.device_type()) +
                           ", expected the CPU or a CUDA device");
}

// Elements and C-contiguity, from the shape and strides (in elements).
int64_t contiguous_numel(const Array& a, const std::string& arg) {
  int64_t numel = 1, expected_stride = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    const int64_t extent = static_cast<int64_t>(a.shape(d));
    if (extent != 1 && a.stride(d) != expected_stride) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, arg,
                           "is not contiguous (dimension " + std::to_string(d) + " has stride " +
                               std::to_string(a.stride(d)) + ", expected " + std::to_string(expected_stride) +
                               "); expected a contiguous tensor (call .contiguous())");
    }
    expected_stride *= extent;
    numel *= extent;
  }
  return numel;
}

TensorView raw_view(const Array& a, const std::string& arg) {
  if (!a.is_valid()) throw_argument_error(ErrorCode::null_pointer, kOp, arg, "is None; expected an array");
  TensorView v;
  v.numel = contiguous_numel(a, arg);
  v.device = to_device(a, arg);
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  return v;
}

}  // namespace

TensorView to_view(const Array& a, const std::string& arg) {
  TensorView v = raw_view(a, arg);
  if (is_bool(a.dtype())) {
    throw_argument_error(ErrorCode::dtype_unsupported, kOp, arg, "has dtype bool, expected float32, float16, bfloat16 or float64");
  }
  v.dtype = to_dtype(a.dtype(), arg);
  return v;
}

ViewList to_views(const std::vector<Array>& arrays, const std::string& arg) {
  ViewList out;
  out.views.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) out.views.push_back(to_view(arrays[i], arg + "[" + std::to_string(i) + "]"));
  out.arrays = arrays;
  return out;
}

void* scalar_pointer(const std::optional<Array>& array, const std::string& arg, nb::dlpack::dtype dtype,
                     std::string_view dtype_text, int64_t count) {
  if (!array) return nullptr;
  const TensorView v = raw_view(*array, arg);
  if (!(array->dtype() == dtype) || v.numel != count) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, arg,
                         "has " + std::to_string(v.numel) + " elements (DLPack dtype code " +
                             std::to_string(array->dtype().code) + ", " + std::to_string(array->dtype().bits) +
                             " bits), expected " + std::to_string(count) + " of " + std::string(dtype_text));
  }
  return v.data;
}

bool* flag_pointer(const std::optional<Array>& array, const std::string& arg, int64_t count) {
  const bool as_bytes = array && array->dtype() == nb::dtype<uint8_t>();
  return static_cast<bool*>(scalar_pointer(array, arg, as_bytes ? nb::dtype<uint8_t>() : nb::dtype<bool>(),
                                           "bool (or uint8 holding 0 or 1)", count));
}

Device to_view_device(const Array& array) { return to_device(array, "array"); }

nb::object to_array(const TensorView& view, nb::handle owner) {
  const size_t shape[1] = {static_cast<size_t>(view.numel)};
  nb::dlpack::dtype t{};
  t.lanes = 1;
  t.bits = static_cast<uint8_t>(dtype_size(view.dtype) * 8);
  t.code = static_cast<uint8_t>(view.dtype == DType::bf16 ? nb::dlpack::dtype_code::Bfloat : nb::dlpack::dtype_code::Float);
  const int device_type = view.device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  // array_api: an object with __dlpack__ and __dlpack_device__, which
  // torch.from_dlpack, numpy.from_dlpack, cupy and jax all take.
  nb::ndarray<nb::array_api> a(view.data, 1, shape, owner, nullptr, t, device_type, view.device.index);
  return nb::cast(a, nb::rv_policy::reference);
}

nb::list to_arrays(std::span<const TensorView> views, nb::handle owner) {
  nb::list out;
  for (const TensorView& v : views) out.append(to_array(v, owner));
  return out;
}

}  // namespace gradkit::python
