#include "support/test_tensor.h"

#include <cstring>
#include <stdexcept>
#include <string>

#ifdef GRADKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace gradkit::test {
namespace {

#ifdef GRADKIT_WITH_CUDA
void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}
#endif

void* allocate(Device device, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (!device.is_cuda()) return ::operator new(bytes);
#ifdef GRADKIT_WITH_CUDA
  check(cudaSetDevice(device.index), "cudaSetDevice");
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
#else
  throw std::runtime_error("test built without CUDA");
#endif
}

void copy(void* dst, const void* src, size_t bytes, Device device, bool to_device) {
  if (!device.is_cuda()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef GRADKIT_WITH_CUDA
  check(cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost), "cudaMemcpy");
#else
  (void)to_device;
#endif
}

}  // namespace

bool cuda_available() { return cuda_device_count() > 0; }

void TestTensor::Free::operator()(void* p) const {
  if (!device.is_cuda()) {
    ::operator delete(p);
    return;
  }
#ifdef GRADKIT_WITH_CUDA
  cudaFree(p);
#endif
}

std::vector<double> round_to(DType dtype, const std::vector<double>& values) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::f32: out[i] = static_cast<float>(v); break;
      case DType::f16: out[i] = static_cast<float>(half(static_cast<float>(v))); break;
      case DType::bf16: out[i] = static_cast<float>(bfloat16(static_cast<float>(v))); break;
      case DType::f64: out[i] = v; break;
    }
  }
  return out;
}

TestTensor::TestTensor(Device device, DType dtype, const std::vector<double>& values)
    : numel_(static_cast<int64_t>(values.size())), dtype_(dtype), device_(device),
      owner_(nullptr, Free{device}) {
  const size_t bytes = values.size() * dtype_size(dtype);
  std::vector<uint8_t> host(bytes);
  for (size_t i = 0; i < values.size(); ++i) {
    dispatch_dtype(dtype, [&]<class T>() {
      const T v = T(static_cast<float>(values[i]));
      if constexpr (std::is_same_v<T, double>) {
        std::memcpy(host.data() + i * sizeof(T), &values[i], sizeof(T));
      } else {
        std::memcpy(host.data() + i * sizeof(T), &v, sizeof(T));
      }
    });
  }
  data_ = allocate(device, bytes);
  owner_.reset(data_);
  copy(data_, host.data(), bytes, device, true);
}

TestTensor::~TestTensor() = default;

std::vector<uint8_t> TestTensor::bytes() const {
  std::vector<uint8_t> host(static_cast<size_t>(numel_) * dtype_size(dtype_));
  copy(host.data(), data_, host.size(), device_, false);
  return host;
}

std::vector<double> TestTensor::read() const {
  const std::vector<uint8_t> host = bytes();
  std::vector<double> out(static_cast<size_t>(numel_));
  dispatch_dtype(dtype_, [&]<class T>() {
    for (size_t i = 0; i < out.size(); ++i) {
      T v;
      std::memcpy(&v, host.data() + i * sizeof(T), sizeof(T));
      out[i] = static_cast<double>(static_cast<std::conditional_t<std::is_same_v<T, double>, double, float>>(v));
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

TestFlag::TestFlag(Device device, bool value) : device_(device) {
  flag_ = static_cast<bool*>(allocate(device, 1));
  copy(flag_, &value, 1, device, true);
}

TestFlag::~TestFlag() { TestTensor::Free{device_}(flag_); }

bool TestFlag::read() const {
  bool v = false;
  copy(&v, flag_, 1, device_, false);
  return v;
}

void synchronize(Device device) {
#ifdef GRADKIT_WITH_CUDA
  if (device.is_cuda()) check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#else
  (void)device;
#endif
}

}  // namespace gradkit::test
