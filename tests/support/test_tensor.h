// Owning test tensors on any device, filled from float64 values, read back as
// float64 or as raw bits. Tests only: the library itself never owns the
// memory its ops work on.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/core/tensor.h"

namespace gradkit::test {

// The devices a backend-generic test runs on; CUDA only when a GPU is visible.
bool cuda_available();

// Its memory is a Buffer, so the allocation is rounded up to whole 256-byte
// blocks (what NCCL needs of a tensor it reads: docs/ops.md) while view()
// has exactly the values' count.
class TestTensor {
 public:
  TestTensor(Device device, DType dtype, const std::vector<double>& values);

  TensorView view() const { return buffer_.view(dtype_, 0, numel_); }
  std::vector<double> read() const;       // as float64 (exact for every dtype)
  std::vector<uint8_t> bytes() const;     // raw bits, for bitwise comparisons
  int64_t numel() const { return numel_; }

 private:
  Buffer buffer_;
  int64_t numel_ = 0;
  DType dtype_ = DType::f32;
};

// Rounds each value to `dtype` and back: what the tensor will hold.
std::vector<double> round_to(DType dtype, const std::vector<double>& values);

// n seeded normal values (never exactly zero), scaled by `scale`.
std::vector<double> random_values(std::mt19937_64& rng, int64_t n, double scale = 1.0);

// A bool flag in device memory (host memory for the CPU).
class TestFlag {
 public:
  TestFlag(Device device, bool value);
  bool* pointer() const { return static_cast<bool*>(buffer_.data()); }
  bool read() const;

 private:
  Buffer buffer_;
};

}  // namespace gradkit::test
