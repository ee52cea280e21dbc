#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
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

  double triad_bandwidth_gbs(size_t bytes, int reps) override {
    const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
    std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
    float* pa = a.get();
    const float* pb = b.get();
    const float* pc = c.get();
    // First touch by the threads that run the triad (the same static split),
    // so that each thread's pages sit on its own memory node.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      a[i] = 0.0f;
      b[i] = 1.0f;
      c[i] = 2.0f;
    }
    const float scalar = 3.0f;
    const double ms = median_ms(
        [&] {
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + scalar * pc[i];
        },
        2, reps);
    return 3.0 * static_cast<double>(n) * sizeof(float) / (ms * 1e6);
  }

  Stream stream() const override { return {}; }
  void synchronize() override {}

 private:
  std::vector<std::unique_ptr<unsigned char[]>> blocks_;
};

}  // namespace

std::unique_ptr<BenchDevice> make_cpu_bench_device() { return std::make_unique<CpuBenchDevice>(); }

}  // namespace gradkit::tool
