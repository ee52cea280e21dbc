// Owning test tensors on any device, filled from float64 values, read back as
// float64 or as raw bits. Tests only: the library itself never owns the
// memory its ops work on.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "gradkit/core/tensor.h"

namespace gradkit::test {

// The devices a backend-generic test runs on; CUDA only when a GPU is visible.
bool cuda_available();

class TestTensor {
 public:
  TestTensor(Device device, DType dtype, const std::vector<double>& values);
  TestTensor(TestTensor&&) noexcept = default;
  TestTensor& operator=(TestTensor&&) noexcept = default;
  ~TestTensor();

  TensorView view() const { return TensorView{data_, numel_, dtype_, device_}; }
  std::vector<double> read() const;       // as float64 (exact for every dtype)
  std::vector<uint8_t> bytes() const;     // raw bits, for bitwise comparisons
  int64_t numel() const { return numel_; }

 private:
  void* data_ = nullptr;
  int64_t numel_ = 0;
  DType dtype_ = DType::f32;
  Device device_;
  struct Free { Device device; void operator()(void* p) const; };
  std::unique_ptr<void, Free> owner_;
  friend class TestFlag;
};

// Rounds each value to `dtype` and back: what the tensor will hold.
std::vector<double> round_to(DType dtype, const std::vector<double>& values);

// n seeded normal values (never exactly zero), scaled by `scale`.
std::vector<double> random_values(std::mt19937_64& rng, int64_t n, double scale = 1.0);

// A bool flag in device memory (host memory for the CPU).
class TestFlag {
 public:
  TestFlag(Device device, bool value);
  ~TestFlag();
  TestFlag(const TestFlag&) = delete;
  TestFlag& operator=(const TestFlag&) = delete;
  bool* pointer() const { return flag_; }
  bool read() const;

 private:
  Device device_;
  bool* flag_ = nullptr;
};

// Waits for all work on the device (no-op for the CPU).
void synchronize(Device device);

}  // namespace gradkit::test
