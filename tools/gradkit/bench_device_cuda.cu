#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bench_device.h"
#include "gradkit/core/error.h"

namespace gradkit::tool {
namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw Error(ErrorCode::cuda_error, std::string(call) + " failed: " + cudaGetErrorString(status));
  }
}
#define BENCH_CUDA(call) check((call), #call)

__device__ float uniform_from(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 11) * 0x1p-52 - 1.0);
}

__global__ void triad_kernel(float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ c,
                             int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    a[i] = b[i] + s * c[i];
  }
}

template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, bool positive) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float v = uniform_from(seed * 0x100000001b3ull + i);
    if (positive) v = fabsf(v);
    if constexpr (std::is_same_v<T, __half>) p[i] = __float2half_rn(v);
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) p[i] = __float2bfloat16_rn(v);
    else p[i] = static_cast<T>(v);
  }
}

class CudaBenchDevice final : public BenchDevice {
 public:
  explicit CudaBenchDevice(int index) : index_(index) {
    if (cuda_device_count() <= index) {
      throw Error(ErrorCode::backend_unavailable, "bench: no CUDA device cuda:" + std::to_string(index));
    }
    BENCH_CUDA(cudaSetDevice(index));
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&start_));
    BENCH_CUDA(cudaEventCreate(&stop_));
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, index));
    name_ = prop.name;
  }
  ~CudaBenchDevice() override {
    for (void* p : blocks_) cudaFree(p);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }

  Device device() const override { return Device::cuda(index_); }
  std::string description() const override { return "cuda:" + std::to_string(index_) + " (" + name_ + ")"; }

  void* allocate(size_t bytes) override {
    void* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
    blocks_.push_back(p);
    return p;
  }

  void fill_random(void* data, int64_t numel, DType dtype, uint64_t seed, bool positive) override {
    dispatch_dtype(dtype, [&]<class T>() {
      using N = std::conditional_t<std::is_same_v<T, half>, __half,
                                   std::conditional_t<std::is_same_v<T, bfloat16>, __nv_bfloat16, T>>;
      fill_kernel<<<1024, 256, 0, stream_>>>(static_cast<N*>(data), numel, seed, positive);
    });
    BENCH_CUDA(cudaGetLastError());
    synchronize();
  }

  void release_all() override {
    synchronize();
    for (void* p : blocks_) cudaFree(p);
    blocks_.clear();
  }

  double median_ms(const std::function<void()>& fn, int warmup, int reps) override {
    for (int i = 0; i < warmup; ++i) fn();
    std::vector<double> times;
    for (int i = 0; i < reps; ++i) {
      BENCH_CUDA(cudaEventRecord(start_, stream_));
      fn();
      BENCH_CUDA(cudaEventRecord(stop_, stream_));
      BENCH_CUDA(cudaEventSynchronize(stop_));
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
      times.push_back(ms);
    }
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    return times[times.size() / 2];
  }

  double copy_bandwidth_gbs(size_t bytes, int reps) override {
    void* a = allocate(bytes);
    void* b = allocate(bytes);
    fill_random(a, static_cast<int64_t>(bytes / 4), DType::f32, 7, false);
    const double ms = median_ms(
        [&] { BENCH_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream_)); }, 3, reps);
    release(a);
    release(b);
    return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
  }

  double triad_bandwidth_gbs(size_t bytes, int reps) override {
    const auto n = static_cast<int64_t>(bytes / sizeof(float));
    auto* a = static_cast<float*>(allocate(bytes));
    auto* b = static_cast<float*>(allocate(bytes));
    auto* c = static_cast<float*>(allocate(bytes));
    fill_random(b, n, DType::f32, 8, false);
    fill_random(c, n, DType::f32, 9, false);
    int sms = 0;
    BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index_));
    double best_ms = 0;
    for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
      const double ms = median_ms([&] { triad_kernel<<<sms * 8, 256, 0, stream_>>>(a, b, c, n, 3.0f); }, 0, 1);
      if (r > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
    }
    BENCH_CUDA(cudaGetLastError());
    release(a);
    release(b);
    release(c);
    return 3.0 * static_cast<double>(n) * sizeof(float) / (best_ms * 1e6);
  }

  Stream stream() const override { return Stream{stream_}; }
  void synchronize() override { BENCH_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  void release(void* p) {
    blocks_.erase(std::find(blocks_.begin(), blocks_.end(), p));
    BENCH_CUDA(cudaFree(p));
  }

  int index_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::vector<void*> blocks_;
};

}  // namespace

std::unique_ptr<BenchDevice> make_cuda_bench_device(int index) { return std::make_unique<CudaBenchDevice>(index); }

}  // namespace gradkit::tool
