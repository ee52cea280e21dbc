// The Adam update as a functor of the multi-tensor driver: one pass, reading
// w, g, m, v (and vmax, and the remainder of bf16 weights) and writing w, m,
// v (vmax, the model copy, the remainder). 8- and 4-bit moments: cuda/adam_low_bit.cu.
#include <type_traits>

#include "spec/adam.h"
#include "spec/adam_math.h"
#include "spec/master_math.h"
#include "cuda/adam_launch.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::spec {
namespace {

using cuda::load;
using cuda::native_t;
using cuda::NoCopy;
using cuda::PlanArgs;
using cuda::store;

// W: the weights' element (f32, f64; or the bits of bf16 weights, uint16_t,
// with kRemainder: their f32 master is completed by the remainder list).
template <class W, class G, class M, class Copy, bool kRemainder>
struct AdamOp {
  using C = std::conditional_t<kRemainder, float, cuda::compute_t<W>>;
  static constexpr bool kCopy = !std::is_same_v<Copy, NoCopy>;
  static constexpr int N = 16 / sizeof(W);
  static constexpr int kUnroll = 2;
  AdamLaunch launch;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    const AdamStepInputs& in = launch.inputs;
    if (in.found_inf != nullptr && *in.found_inf) return;

    // The group's constants for this step, computed once per block.
    __shared__ AdamCoefficients<C> shared;
    if (threadIdx.x == 0) shared = cuda::chunk_coefficients<C>(plan, chunk, launch);
    __syncthreads();
    const AdamCoefficients<C> c = shared;
    const C scale = static_cast<C>(in.grad_scale_device != nullptr ? *in.grad_scale_device : in.grad_scale);
    const bool scaled = scale != C(1);

    W* w = plan.tensor<W>(0, chunk);
    const G* g = plan.tensor<G>(1, chunk);
    M* m = plan.tensor<M>(2, chunk);
    M* v = plan.tensor<M>(3, chunk);
    M* vmax = c.amsgrad ? plan.tensor<M>(launch.max_list, chunk) : nullptr;
    Copy* copy = nullptr;
    if constexpr (kCopy) copy = plan.tensor<Copy>(launch.copy_list, chunk);
    int16_t* rem = nullptr;
    if constexpr (kRemainder) rem = plan.tensor<int16_t>(launch.remainder_list, chunk);

    const bool vectorized = cuda::vector_aligned<N>(w) && cuda::vector_aligned<N>(g) && cuda::vector_aligned<N>(m) &&
                            cuda::vector_aligned<N>(v) && (vmax == nullptr || cuda::vector_aligned<N>(vmax)) &&
                            (!kCopy || cuda::vector_aligned<N>(copy)) && (!kRemainder || cuda::vector_aligned<N>(rem));

    auto update = [&](W& wi, int16_t& ri, G gi, M& mi, M& vi, M* vmaxi, Copy* copyi) {
      C wc;
      if constexpr (kRemainder) wc = join_master(wi, ri);
      else wc = cuda::to_compute<C>(wi);
      C gc = cuda::to_compute<C>(gi);
      if (scaled) gc = gc / scale;
      C mc = cuda::to_compute<C>(mi), vc = cuda::to_compute<C>(vi);
      C vmaxc = vmaxi != nullptr ? cuda::to_compute<C>(*vmaxi) : C(0);
      adam_element(wc, gc, mc, vc, vmaxc, c);
      if constexpr (kRemainder) split_master(wc, wi, ri);
      else wi = cuda::from_compute<W>(wc);
      mi = cuda::from_compute<M>(mc);
      vi = cuda::from_compute<M>(vc);
      if (vmaxi != nullptr) *vmaxi = cuda::from_compute<M>(vmaxc);
      if constexpr (kCopy) *copyi = cuda::from_compute<Copy>(wc);
    };

    cuda::for_each_group<N, kUnroll>(
        chunk.length, vectorized,
        [&]<int U>(int i, int stride, bool vec) {
          W wr[U][N];
          G gr[U][N];
          M mr[U][N], vr[U][N], xr[U][N];
          int16_t rr[U][N];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int at = i + u * stride;
            load<N>(wr[u], w + at, vec);
            if constexpr (kRemainder) load<N>(rr[u], rem + at, vec);
            load<N>(gr[u], g + at, vec);
            load<N>(mr[u], m + at, vec);
            load<N>(vr[u], v + at, vec);
            if (vmax != nullptr) load<N>(xr[u], vmax + at, vec);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int at = i + u * stride;
            [[maybe_unused]] std::conditional_t<kCopy, Copy, char> cr[N];
#pragma unroll
            for (int k = 0; k < N; ++k) {
              if constexpr (kCopy) update(wr[u][k], rr[u][k], gr[u][k], mr[u][k], vr[u][k], vmax ? &xr[u][k] : nullptr, &cr[k]);
              else update(wr[u][k], rr[u][k], gr[u][k], mr[u][k], vr[u][k], vmax ? &xr[u][k] : nullptr, nullptr);
            }
            store<N>(w + at, wr[u], vec);
            if constexpr (kRemainder) store<N>(rem + at, rr[u], vec);
            store<N>(m + at, mr[u], vec);
            store<N>(v + at, vr[u], vec);
            if (vmax != nullptr) store<N>(vmax + at, xr[u], vec);
            if constexpr (kCopy) store<N>(copy + at, cr, vec);
          }
        },
        [&](int j) {
          int16_t unused = 0;
          int16_t& rj = kRemainder ? rem[j] : unused;
          if constexpr (kCopy) update(w[j], rj, g[j], m[j], v[j], vmax ? vmax + j : nullptr, copy + j);
          else update(w[j], rj, g[j], m[j], v[j], vmax ? vmax + j : nullptr, nullptr);
        });
  }
};

template <class Weights, class G, class M, class Copy>
void launch_adam(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
  constexpr bool kRemainder = std::is_same_v<Weights, cuda::RemainderWeights>;
  using W = std::conditional_t<kRemainder, uint16_t, Weights>;
  cuda::launch_multi_tensor(plan, AdamOp<native_t<W>, native_t<G>, native_t<M>, native_t<Copy>, kRemainder>{launch},
                            stream);
}

// The float-moment kernels, for the dispatch in cuda/adam_launch.cuh.
template <class Weights, class G, class M, class Copy>
struct FloatMoments {
  static void launch(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
    launch_adam<Weights, G, M, Copy>(plan, launch, stream);
  }
};

}  // namespace

void adam_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
  if (launch.absmax_list >= 0) {
    return launch.moment_bits == 4 ? adam_int4_cuda(plan, launch, stream) : adam_int8_cuda(plan, launch, stream);
  }
  if (plan.dtype(0) == DType::f64) return launch_adam<double, double, double, cuda::NoCopy>(plan, launch, stream);
  cuda::dispatch_adam<FloatMoments>(plan, launch, stream);
}

}  // namespace gradkit::spec
