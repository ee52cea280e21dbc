#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "bench_device.h"

namespace gradkit::tool {
namespace {

// A 64-bit mix (splitmix64) turned into a uniform value in [-1, 1).
double uniform_from(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) * 0x1p-52 - 1.0;
}

void triad(float* __restrict a, const float* __restrict b, const float* __restrict c, int64_t n, float s) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

class CpuBenchDevice final : public BenchDevice {
 public:
  Device device() const override { return Device::cpu(); }
  std::string description() const override { return "cpu"; }

  void* allocate(size_t bytes) override {
    blocks_.emplace_back(new unsigned char[std::max<size_t>(bytes, 1)]);
    return blocks_.back().get();
  }

  void fill_random(void* data, int64_t numel, DType dtype, uint64_t seed, bool positive) override {
    dispatch_dtype(dtype, [&]<class T>() {
      T* p = static_cast<T*>(data);
      for (int64_t i = 0; i < numel; ++i) {
        const double u = uniform_from(seed * 0x100000001b3ull + i);
        p[i] = T(static_cast<float>(positive ? std::abs(u) : u));
      }
    });
  }

  void release_all() override { blocks_.clear(); }

  double median_ms(const std::function<void()>& fn, int warmup, int reps) override {
    for (int i = 0; i < warmup; ++i) fn();
    std::vector<double> times;
    for (int i = 0; i < reps; ++i) {
      const auto start = std::chrono::steady_clock::now();
      fn();
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    return times[times.size() / 2];
  }

  double copy_bandwidth_gbs(size_t bytes, int reps) override {
    std::vector<unsigned char> a(bytes, 1), b(bytes, 2);
    const double ms = median_ms([&] { std::memcpy(b.data(), a.data(), bytes); }, 1, reps);
    return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
  }

  // The arrays are first touched by the threads that use them (the same
  // static schedule), so each page sits on its thread's memory node.
  double triad_bandwidth_gbs(size_t bytes, int reps) override {
    const auto n = static_cast<int64_t>(bytes / sizeof(float));
    std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      a[i] = 0.0f;
      b[i] = 1.0f;
      c[i] = 2.0f;
    }
    const float s = 3.0f;
    double best = 0;
    for (int r = 0; r < reps; ++r) {
      const auto start = std::chrono::steady_clock::now();
      triad(a.get(), b.get(), c.get(), n, s);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, 3.0 * static_cast<double>(n) * sizeof(float) / (ms * 1e6));
    }
    return best;
  }

  Stream stream() const override { return {}; }
  void synchronize() override {}

 private:
  std::vector<std::unique_ptr<unsigned char[]>> blocks_;
};

}  // namespace

std::unique_ptr<BenchDevice> make_cpu_bench_device() { return std::make_unique<CpuBenchDevice>(); }

}  // namespace gradkit::tool
