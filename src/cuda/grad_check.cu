// The gradient check on CUDA: a functor of the multi-tensor driver that
// leaves per-chunk partials, then two small kernels that combine them in a
// fixed order (per-tensor norms: a warp per tensor; the global norm, the
// flag and the divisor: one block).
#include <type_traits>

#include "spec/grad_check.h"
#include "spec/grad_check_math.h"
#include "spec/lamb_math.h"  // finite()
#include "cuda/block_reduce.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::spec {
namespace {

using cuda::PlanArgs;

__device__ __forceinline__ float loss_scale_of(const GradCheckLaunch& l) {
  return l.loss_scale_device != nullptr ? *l.loss_scale_device : l.loss_scale;
}

template <class G>
struct CheckPass {
  static constexpr int N = 16 / sizeof(G) > 8 ? 8 : 16 / sizeof(G);
  GradCheckLaunch launch;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    const NormType type = launch.options.norm;
    const float scale = loss_scale_of(launch);
    const double inv_scale = 1.0 / static_cast<double>(scale);
    const float inv_scale_f = 1.0f / scale;
    const bool write = launch.options.write_unscaled;
    G* g = plan.tensor<G>(0, chunk);
    const bool vectorized = cuda::vector_aligned<N>(g);
    double partial = 0;
    bool nonfinite = false;
    auto visit = [&](G& value) {
      const float raw = cuda::to_compute<float>(value);
      nonfinite |= !finite(raw);
      partial = norm_accumulate(partial, static_cast<double>(raw) * inv_scale, type);
      if (write) value = cuda::from_compute<G>(raw * inv_scale_f);
    };
    cuda::for_each_value<N, 2>(chunk.length, g, vectorized, write, [&](int, G& value) { visit(value); });
    partial = cuda::block_reduce(partial, [type](double a, double b) { return norm_combine(a, b, type); });
    nonfinite = __syncthreads_or(nonfinite);
    if (threadIdx.x == 0) {
      launch.partial_norms[blockIdx.x] = partial;  // one block per chunk: blockIdx.x is the chunk
      launch.partial_flags[blockIdx.x] = nonfinite;
    }
  }
};

constexpr int kNormWarps = 8;

__global__ void tensor_norms_kernel(PlanArgs plan, GradCheckLaunch launch) {
  const int64_t t = blockIdx.x * int64_t{kNormWarps} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= plan.num_tensors) return;  // uniform across the warp
  const NormType type = launch.options.norm;
  const auto combine = [type](double a, double b) { return norm_combine(a, b, type); };
  double partial = 0;
  bool nonfinite = false;
  for (int64_t c = plan.first_chunk(t) + lane, end = plan.first_chunk(t + 1); c < end; c += 32) {
    partial = combine(partial, launch.partial_norms[c]);
    nonfinite |= launch.partial_flags[c];
  }
  partial = cuda::warp_reduce(partial, combine);
  nonfinite = __any_sync(0xffffffffu, nonfinite);
  if (lane == 0) launch.outputs.tensor_norms[t] = nonfinite ? NAN : static_cast<float>(norm_finish(partial, type));
}

// One block: thread k combines chunks k, k + blockDim.x, ... in order, then
// the block combines the threads in a fixed tree.
__global__ void global_kernel(int64_t num_chunks, GradCheckLaunch launch) {
  const NormType type = launch.options.norm;
  const auto combine = [type](double a, double b) { return norm_combine(a, b, type); };
  double partial = 0;
  bool nonfinite = false;
  for (int64_t c = threadIdx.x; c < num_chunks; c += blockDim.x) {
    partial = combine(partial, launch.partial_norms[c]);
    nonfinite |= launch.partial_flags[c];
  }
  partial = cuda::block_reduce(partial, combine);
  nonfinite = __syncthreads_or(nonfinite);
  if (threadIdx.x == 0) {
    write_check_outputs(launch.outputs, partial, nonfinite, type, loss_scale_of(launch), launch.options.max_norm);
  }
}

// A handful of lists (one per rank): one thread combines them in order.
__global__ void combine_kernel(const double* partials, int count, GradCheckLaunch launch) {
  double partial = 0;
  bool nonfinite = false;
  combine_partials(partials, count, launch.options.norm, &partial, &nonfinite);
  write_check_outputs(launch.outputs, partial, nonfinite, launch.options.norm, loss_scale_of(launch),
                      launch.options.max_norm);
}

}  // namespace

void grad_check_cuda(const MultiTensorPlan& plan, const GradCheckLaunch& l, Stream stream) {
  cuda::DeviceGuard guard(plan.device().index);
  if (!plan.empty()) {
    dispatch_dtype(plan.dtype(0), [&]<class G>() {
      if constexpr (!std::is_same_v<G, double>) cuda::launch_multi_tensor(plan, CheckPass<cuda::native_t<G>>{l}, stream);
    });
  }
  const cuda::PlanArgs args = plan.empty() ? cuda::PlanArgs{} : cuda::plan_args(plan);
  if (l.outputs.tensor_norms != nullptr && plan.num_tensors() > 0) {
    if (plan.empty()) {  // every tensor empty: norms are 0
      GRADKIT_CUDA_CHECK(cudaMemsetAsync(l.outputs.tensor_norms, 0, sizeof(float) * plan.num_tensors(), cuda::native(stream)));
    } else {
      const auto blocks = static_cast<unsigned>((plan.num_tensors() + kNormWarps - 1) / kNormWarps);
      tensor_norms_kernel<<<blocks, 32 * kNormWarps, 0, cuda::native(stream)>>>(args, l);
      GRADKIT_CUDA_CHECK_LAUNCH();
    }
  }
  global_kernel<<<1, 1024, 0, cuda::native(stream)>>>(args.num_chunks, l);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

void grad_check_combine_cuda(Device device, const double* partials, int count, const GradCheckLaunch& l,
                             Stream stream) {
  cuda::DeviceGuard guard(device.index);
  combine_kernel<<<1, 1, 0, cuda::native(stream)>>>(partials, count, l);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gradkit::spec
