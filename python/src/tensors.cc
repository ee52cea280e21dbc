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
    // The storage dtypes of encoded optimizer state (8-bit moments, remainders).
    if (t.code == static_cast<uint8_t>(dtype_code::UInt) && t.bits == 8) return DType::u8;
    if (t.code == static_cast<uint8_t>(dtype_code::Int) && t.bits == 16) return DType::i16;
  }
  throw_argument_error(ErrorCode::dtype_unsupported, kOp, arg,
                       "has DLPack dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
                           " bits), expected float32, float16, bfloat16 or float64 (or uint8, int16 for encoded state)");
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

DeviceScalar make_device_scalar(const Array& array, const std::string& arg) {
  const TensorView v = raw_view(array, arg);
  return DeviceScalar{array, v.data, v.numel, array.dtype(), v.device};
}

namespace {

// The scalar behind an argument, converting an array on the spot.
const DeviceScalar& as_scalar(nb::handle scalar, const std::string& arg, DeviceScalar& converted) {
  if (nb::isinstance<DeviceScalar>(scalar)) return *nb::inst_ptr<DeviceScalar>(scalar);
  Array array;
  if (!nb::try_cast<Array>(scalar, array)) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, arg,
                         "is a " + std::string(nb::type_name(scalar.type()).c_str()) +
                             ", expected None, a gradkit.DeviceScalar or a DLPack array");
  }
  converted = make_device_scalar(array, arg);
  return converted;
}

std::string dtype_text(nb::dlpack::dtype t) {
  return "DLPack dtype code " + std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits";
}

}  // namespace

void* scalar_pointer(nb::handle scalar, const std::string& arg, nb::dlpack::dtype dtype, std::string_view text,
                     int64_t count) {
  if (!scalar.is_valid() || scalar.is_none()) return nullptr;
  DeviceScalar converted;
  const DeviceScalar& s = as_scalar(scalar, arg, converted);
  if (!(s.dtype == dtype) || s.numel != count) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, arg,
                         "has " + std::to_string(s.numel) + " elements (" + dtype_text(s.dtype) + "), expected " +
                             std::to_string(count) + " of " + std::string(text));
  }
  return s.data;
}

bool* flag_pointer(nb::handle flag, const std::string& arg, int64_t count) {
  if (!flag.is_valid() || flag.is_none()) return nullptr;
  DeviceScalar converted;
  const DeviceScalar& s = as_scalar(flag, arg, converted);
  if (!(s.dtype == nb::dtype<bool>() || s.dtype == nb::dtype<uint8_t>()) || s.numel != count) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, arg,
                         "has " + std::to_string(s.numel) + " elements (" + dtype_text(s.dtype) + "), expected " +
                             std::to_string(count) + " of bool (or uint8 holding 0 or 1)");
  }
  return static_cast<bool*>(s.data);
}

Device scalar_device(nb::handle scalar, const std::string& arg) {
  DeviceScalar converted;
  return as_scalar(scalar, arg, converted).device;
}

nb::object to_array(const TensorView& view, nb::handle owner) {
  const size_t shape[1] = {static_cast<size_t>(view.numel)};
  nb::dlpack::dtype t{};
  t.lanes = 1;
  t.bits = static_cast<uint8_t>(dtype_size(view.dtype) * 8);
  t.code = static_cast<uint8_t>(view.dtype == DType::bf16  ? nb::dlpack::dtype_code::Bfloat
                                : view.dtype == DType::u8  ? nb::dlpack::dtype_code::UInt
                                : view.dtype == DType::i16 ? nb::dlpack::dtype_code::Int
                                                           : nb::dlpack::dtype_code::Float);
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
