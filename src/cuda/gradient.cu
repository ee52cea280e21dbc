// CUDA kernels for zero and accumulate, as functors of the multi-tensor driver.
#include "spec/dtype_pairs.h"
#include "spec/gradient.h"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::spec {
namespace {

using cuda::for_each_group;
using cuda::load;
using cuda::native_t;
using cuda::PlanArgs;
using cuda::store;

template <class T>
struct ZeroOp {
  static constexpr int N = 16 / sizeof(T);
  __device__ void operator()(const PlanArgs& plan, const PlanChunk& c) const {
    T* out = plan.tensor<T>(0, c);
    const bool vectorized = cuda::vector_aligned<N>(out);
    T zeros[N];
#pragma unroll
    for (int k = 0; k < N; ++k) zeros[k] = cuda::from_compute<T>(0.0f);
    for_each_group<N, 1>(
        c.length, vectorized,
        [&]<int U>(int i, int stride, bool vec) {
#pragma unroll
          for (int u = 0; u < U; ++u) store<N>(out + i + u * stride, zeros, vec);
        },
        [&](int j) { out[j] = zeros[0]; });
  }
};

template <class B, class V>
struct AccumulateOp {
  using C = cuda::compute_t<B>;
  static constexpr int N = 16 / (sizeof(B) > sizeof(V) ? sizeof(B) : sizeof(V));
  static constexpr int kUnroll = 4;
  const bool* do_update;
  const bool* overwrite;
  bool overwrite_value;

  __device__ static B combine(B b, V v, bool overwrite) {
    const C value = cuda::to_compute<C>(v);
    return cuda::from_compute<B>(overwrite ? value : cuda::to_compute<C>(b) + value);
  }

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& c) const {
    if (do_update != nullptr && !*do_update) return;
    const bool ow = overwrite != nullptr ? *overwrite : overwrite_value;
    B* buf = plan.tensor<B>(0, c);
    const V* val = plan.tensor<V>(1, c);
    const bool vectorized = cuda::vector_aligned<N>(buf) && cuda::vector_aligned<N>(val);
    for_each_group<N, kUnroll>(
        c.length, vectorized,
        [&]<int U>(int i, int stride, bool vec) {
          B b[U][N];
          V v[U][N];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (!ow) load<N>(b[u], buf + i + u * stride, vec);
            load<N>(v[u], val + i + u * stride, vec);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int k = 0; k < N; ++k) b[u][k] = combine(b[u][k], v[u][k], ow);
            store<N>(buf + i + u * stride, b[u], vec);
          }
        },
        [&](int j) { buf[j] = combine(buf[j], val[j], ow); });
  }
};

}  // namespace

void zero_cuda(const MultiTensorPlan& plan, Stream stream) {
  dispatch_dtype(plan.dtype(0), [&]<class T>() {
    cuda::launch_multi_tensor(plan, ZeroOp<native_t<T>>{}, stream);
  });
}

void accumulate_cuda(const MultiTensorPlan& plan, const AccumulateArgs& args, Stream stream) {
  dispatch_dtype_pair({plan.dtype(0), plan.dtype(1)}, [&]<class B, class V>() {
    if constexpr (is_accumulate_pair_v<B, V>) {
      cuda::launch_multi_tensor(
          plan, AccumulateOp<native_t<B>, native_t<V>>{args.do_update, args.overwrite, args.overwrite_value},
          stream);
    }
  });
}

void set_device_flag_cuda(Device device, bool* flag, Stream stream) {
  cuda::DeviceGuard guard(device.index);
  GRADKIT_CUDA_CHECK(cudaMemsetAsync(flag, 1, sizeof(bool), cuda::native(stream)));
}

}  // namespace gradkit::spec
