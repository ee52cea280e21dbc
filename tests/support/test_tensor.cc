#include "support/test_tensor.h"

#include <cstring>

namespace gradkit::test {

bool cuda_available() { return cuda_device_count() > 0; }

namespace {

// dispatch_dtype, with the storage dtypes as their integers (u8, i16 hold
// codes and remainders, which the tests write and read as such).
template <class Fn>
void dispatch_element(DType dtype, Fn&& fn) {
  if (dtype == DType::u8) return fn.template operator()<uint8_t>();
  if (dtype == DType::i16) return fn.template operator()<int16_t>();
  dispatch_dtype(dtype, fn);
}

}  // namespace

std::vector<double> round_to(DType dtype, const std::vector<double>& values) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::f32: out[i] = static_cast<float>(v); break;
      case DType::f16: out[i] = static_cast<float>(half(static_cast<float>(v))); break;
      case DType::bf16: out[i] = static_cast<float>(bfloat16(static_cast<float>(v))); break;
      case DType::f64: out[i] = v; break;
      case DType::u8:
      case DType::i16: out[i] = v; break;  // not a float format; tests do not round to it
    }
  }
  return out;
}

TestTensor::TestTensor(Device device, DType dtype, const std::vector<double>& values)
    : buffer_(device, values.size() * dtype_size(dtype)), numel_(static_cast<int64_t>(values.size())), dtype_(dtype) {
  std::vector<uint8_t> host(values.size() * dtype_size(dtype));
  dispatch_element(dtype, [&]<class T>() {
    for (size_t i = 0; i < values.size(); ++i) {
      T v;
      if constexpr (std::is_same_v<T, double> || std::is_integral_v<T>) v = static_cast<T>(values[i]);
      else v = T(static_cast<float>(values[i]));
      std::memcpy(host.data() + i * sizeof(T), &v, sizeof(T));
    }
  });
  copy_from_host(buffer_.data(), device, host.data(), host.size());
}

std::vector<uint8_t> TestTensor::bytes() const {
  std::vector<uint8_t> host(static_cast<size_t>(numel_) * dtype_size(dtype_));
  copy_to_host(host.data(), buffer_.data(), host.size(), buffer_.device());
  return host;
}

std::vector<double> TestTensor::read() const {
  const std::vector<uint8_t> host = bytes();
  std::vector<double> out(static_cast<size_t>(numel_));
  dispatch_element(dtype_, [&]<class T>() {
    for (size_t i = 0; i < out.size(); ++i) {
      T v;
      std::memcpy(&v, host.data() + i * sizeof(T), sizeof(T));
      if constexpr (std::is_same_v<T, double> || std::is_integral_v<T>) out[i] = v;
      else out[i] = static_cast<float>(v);
    }
  });
  return out;
}

std::vector<double> random_values(std::mt19937_64& rng, int64_t n, double scale) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> out(static_cast<size_t>(n));
  for (double& v : out) {
    do v = normal(rng) * scale;
    while (v == 0.0);
  }
  return out;
}

TestFlag::TestFlag(Device device, bool value) : buffer_(device, 1) {
  copy_from_host(buffer_.data(), device, &value, 1);
}

bool TestFlag::read() const {
  bool v = false;
  copy_to_host(&v, buffer_.data(), 1, buffer_.device());
  return v;
}

}  // namespace gradkit::test
