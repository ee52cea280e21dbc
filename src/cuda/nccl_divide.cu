#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "spec/nccl_divide.h"
#include "gradkit/core/device.h"
#include "cuda/check.h"
#include "cuda/multi_tensor.cuh"

namespace gradkit::comm {

namespace {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

// The one rounding rule of the average, shared by both kernels.
template <class T>
__device__ __forceinline__ T divided(T x, int divisor) {
  if constexpr (std::is_same_v<T, double>) return x / static_cast<double>(divisor);
  else return from_float<T>(__fdiv_rn(to_float(x), static_cast<float>(divisor)));
}

template <class T>
__global__ void divide_kernel(T* data, int64_t count, int divisor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    data[i] = divided(data[i], divisor);
  }
}

// The same over every tensor of a plan's list 0, one block per chunk.
template <class T>
struct DivideOp {
  static constexpr int N = 16 / sizeof(T);
  int divisor;

  __device__ void operator()(const cuda::PlanArgs& plan, const PlanChunk& c) const {
    T* data = plan.tensor<T>(0, c);
    const bool vectorized = cuda::vector_aligned<N>(data);
    cuda::for_each_value<N, 4>(c.length, data, vectorized, true, [&](int, T& x) { x = divided(x, divisor); });
  }
};

template <class T>
void launch(void* data, int64_t count, int divisor, cudaStream_t stream) {
  constexpr int kThreads = 256;
  // A grid-stride loop over at most 8192 blocks: enough to fill any GPU,
  // and the element count is not limited by the grid.
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((count + kThreads - 1) / kThreads, 8192));
  divide_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(data), count, divisor);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_list(const MultiTensorPlan& plan, int divisor, cudaStream_t stream) {
  cuda::launch_multi_tensor(plan, DivideOp<T>{divisor}, Stream{stream});
}

}  // namespace

void divide_on_device(const MultiTensorPlan& plan, int divisor, cudaStream_t stream) {
  if (plan.empty() || divisor == 1) return;  // x / 1 is x: one rank's average moves nothing
  switch (plan.dtype(0)) {
    case DType::f32: return launch_list<float>(plan, divisor, stream);
    case DType::f16: return launch_list<__half>(plan, divisor, stream);
    case DType::bf16: return launch_list<__nv_bfloat16>(plan, divisor, stream);
    case DType::f64: return launch_list<double>(plan, divisor, stream);
    case DType::u8:
    case DType::i16: return;  // refused by inspect_list
  }
}

void divide_on_device(void* data, int64_t count, DType dtype, int divisor, cudaStream_t stream) {
  if (count == 0 || divisor == 1) return;
  switch (dtype) {
    case DType::f32: return launch<float>(data, count, divisor, stream);
    case DType::f16: return launch<__half>(data, count, divisor, stream);
    case DType::bf16: return launch<__nv_bfloat16>(data, count, divisor, stream);
    case DType::f64: return launch<double>(data, count, divisor, stream);
    case DType::u8:
    case DType::i16: return;  // refused by inspect_list
  }
}

}  // namespace gradkit::comm
