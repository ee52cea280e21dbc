// LAMB in two passes over memory (see spec/lamb.h for the plan), with a
// small kernel between them that turns per-chunk partial sums into
// per-tensor trust ratios in a fixed order.
//
// W is the weights' element: f32, f64, or the bits of bf16 weights (uint16_t)
// with kRemainder, whose f32 master the remainder list completes. Each
// thread takes N = 16 / sizeof(C) consecutive elements, C the compute type,
// whatever the weights' storage: the per-block f32 sums of w^2 and d^2 then
// add the same values in the same order with and without remainders, so the
// remainder master is the f32 master bit for bit.
#include <type_traits>

#include "spec/lamb.h"
#include "spec/lamb_math.h"
#include "spec/master_math.h"
#include "cuda/block_reduce.cuh"
#include "cuda/lamb_launch.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::spec {
namespace {

using cuda::load;
using cuda::native_t;
using cuda::PlanArgs;
using cuda::store;
using cuda::block_coefficients;
using cuda::step_enabled;

struct None {};

// The weight (the master, with kRemainder) as the compute type.
template <class C, bool kRemainder, class W>
__device__ __forceinline__ C master_of(W w, int16_t r) {
  if constexpr (kRemainder) return join_master(w, r);
  else return cuda::to_compute<C>(w);
}

template <class W, class G, class M, bool kRemainder>
struct NormsPass {
  using C = std::conditional_t<kRemainder, float, cuda::compute_t<W>>;
  static constexpr int N = 16 / sizeof(C);
  LambLaunch launch;

  // Pass 1 for one element: new moments (or the old ones, marked, where d is
  // not finite) and the element's contributions to |w|^2 and |d|^2.
  __device__ static void element(C w, G gi, M& mi, M& vi, const LambCoefficients<C>& c, C& w2, C& d2) {
    C m = cuda::to_compute<C>(mi), v = cuda::to_compute<C>(vi);
    lamb_moments(cuda::to_compute<C>(gi), m, v, c);
    const M m_stored = cuda::from_compute<M>(m), v_stored = cuda::from_compute<M>(v);
    const C d = lamb_direction(w, cuda::to_compute<C>(m_stored), cuda::to_compute<C>(v_stored), c);
    if (finite(d)) {
      mi = m_stored;
      vi = v_stored;
      d2 += d * d;
    } else {
      vi = cuda::from_compute<M>(-cuda::to_compute<C>(vi));  // mark: old v with its sign bit set
    }
    w2 += w * w;
  }

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    if (!step_enabled(launch)) return;
    const LambCoefficients<C> c = block_coefficients<C>(plan, chunk, launch);
    const W* w = plan.tensor<W>(0, chunk);
    const G* g = plan.tensor<G>(1, chunk);
    M* m = plan.tensor<M>(2, chunk);
    M* v = plan.tensor<M>(3, chunk);
    const int16_t* rem = nullptr;
    if constexpr (kRemainder) rem = plan.tensor<int16_t>(launch.remainder_list, chunk);
    const bool vectorized = cuda::vector_aligned<N>(w) && cuda::vector_aligned<N>(g) &&
                            cuda::vector_aligned<N>(m) && cuda::vector_aligned<N>(v) &&
                            (!kRemainder || cuda::vector_aligned<N>(rem));
    C w2 = 0, d2 = 0;  // f32 sums in a block (f64 for f64 data), f64 across chunks
    cuda::for_each_group<N, 2>(
        chunk.length, vectorized,
        [&]<int U>(int i, int stride, bool vec) {
          W wr[U][N];
          [[maybe_unused]] int16_t rr[U][N];
          G gr[U][N];
          M mr[U][N], vr[U][N];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            load<N>(wr[u], w + i + u * stride, vec);
            if constexpr (kRemainder) load<N>(rr[u], rem + i + u * stride, vec);
            load<N>(gr[u], g + i + u * stride, vec);
            load<N>(mr[u], m + i + u * stride, vec);
            load<N>(vr[u], v + i + u * stride, vec);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
              const C wc = master_of<C, kRemainder>(wr[u][k], kRemainder ? rr[u][k] : int16_t{0});
              element(wc, gr[u][k], mr[u][k], vr[u][k], c, w2, d2);
            }
            store<N>(m + i + u * stride, mr[u], vec);
            store<N>(v + i + u * stride, vr[u], vec);
          }
        },
        [&](int j) {
          element(master_of<C, kRemainder>(w[j], kRemainder ? rem[j] : int16_t{0}), g[j], m[j], v[j], c, w2, d2);
        });
    w2 = cuda::block_reduce(w2, cuda::Plus{});
    d2 = cuda::block_reduce(d2, cuda::Plus{});
    if (threadIdx.x == 0) {
      launch.partials[2 * blockIdx.x] = w2;  // one block per chunk: blockIdx.x is the chunk
      launch.partials[2 * blockIdx.x + 1] = d2;
    }
  }
};

// Between the passes: one warp per tensor sums its chunks' partials (chunks
// are stored in tensor order) into the trust ratio. Lane k takes chunks k,
// k + 32, ... in order, then the lanes combine in a fixed shuffle tree: the
// same order on every run, and a tensor of thousands of chunks costs a few
// dozen dependent loads rather than thousands.
constexpr int kRatioWarps = 8;

//
// A split step (spec/lamb.h): the first pass writes the two sums out
// instead of the ratio; the second reads each tensor's sums from every row,
// in row order (one lane: a handful of rows), and makes the ratio.
__global__ void ratios_kernel(PlanArgs plan, LambLaunch launch) {
  const int64_t t = blockIdx.x * int64_t{kRatioWarps} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= plan.num_tensors || !step_enabled(launch)) return;  // uniform across the warp
  const LambSplit& split = launch.inputs.split;
  double w2 = 0, d2 = 0;
  if (split.pass == LambPass::second) {
    if (lane != 0) return;
    for (int r = 0; r < split.rows; ++r) {
      const double* row = split.sums + r * split.row_stride + 2 * static_cast<int64_t>(split.index[t]);
      w2 += row[0];
      d2 += row[1];
    }
    launch.ratios[t] = lamb_ratio(w2, d2, launch.groups[plan.groups[t]]);
    return;
  }
  const int64_t begin = plan.first_chunk(t), end = plan.first_chunk(t + 1);
  for (int64_t c = begin + lane; c < end; c += 32) {
    w2 += launch.partials[2 * c];
    d2 += launch.partials[2 * c + 1];
  }
  w2 = cuda::warp_reduce(w2, cuda::Plus{});
  d2 = cuda::warp_reduce(d2, cuda::Plus{});
  if (lane != 0) return;
  if (split.pass == LambPass::first) {
    split.sums[2 * static_cast<int64_t>(split.index[t])] = w2;
    split.sums[2 * static_cast<int64_t>(split.index[t]) + 1] = d2;
  } else {
    launch.ratios[t] = lamb_ratio(w2, d2, launch.groups[plan.groups[t]]);
  }
}

// With kRemainder neither a copy nor an update list (the validation refuses both).
template <class W, class M, class Copy, class Update, bool kRemainder>
struct UpdatePass {
  using C = std::conditional_t<kRemainder, float, cuda::compute_t<W>>;
  static constexpr bool kCopy = !std::is_same_v<Copy, None>;
  static constexpr bool kUpdate = !std::is_same_v<Update, None>;
  static_assert(!kRemainder || (!kCopy && !kUpdate));
  static constexpr int N = 16 / sizeof(C);
  LambLaunch launch;

  // Pass 2 for one element: returns the new weight (the old one where the
  // element is marked or the new weight would not be finite).
  __device__ static C element(C w, M mi, M& vi, C step, const LambCoefficients<C>& c) {
    const C v = cuda::to_compute<C>(vi);
    if (signbit(v)) {  // marked in pass 1: d was not finite, the update is 0
      vi = cuda::from_compute<M>(-v);
      return w;
    }
    const C updated = lamb_apply(w, step, lamb_direction(w, cuda::to_compute<C>(mi), v, c));
    return finite(updated) ? updated : w;
  }

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    if (!step_enabled(launch)) return;
    const LambCoefficients<C> c = block_coefficients<C>(plan, chunk, launch);
    const C step = exact::mul(c.eta, static_cast<C>(launch.ratios[chunk.tensor]));
    W* w = plan.tensor<W>(0, chunk);
    const M* m = plan.tensor<M>(2, chunk);
    M* v = plan.tensor<M>(3, chunk);
    Copy* copy = nullptr;
    Update* delta = nullptr;
    int16_t* rem = nullptr;
    if constexpr (kCopy) copy = plan.tensor<Copy>(launch.copy_list, chunk);
    if constexpr (kUpdate) delta = plan.tensor<Update>(launch.update_list, chunk);
    if constexpr (kRemainder) rem = plan.tensor<int16_t>(launch.remainder_list, chunk);
    const bool vectorized = cuda::vector_aligned<N>(w) && cuda::vector_aligned<N>(m) && cuda::vector_aligned<N>(v) &&
                            (!kCopy || cuda::vector_aligned<N>(copy)) && (!kUpdate || cuda::vector_aligned<N>(delta)) &&
                            (!kRemainder || cuda::vector_aligned<N>(rem));
    // The new weight into the weights (and remainders), or the delta into the update list.
    auto write = [&](W& wi, int16_t& ri, C w_old, C w_new, auto* cp, auto* up) {
      if constexpr (kUpdate) *up = cuda::from_compute<Update>(w_new - w_old);
      else if constexpr (kRemainder) split_master(w_new, wi, ri);
      else wi = cuda::from_compute<W>(w_new);
      if constexpr (kCopy) *cp = cuda::from_compute<Copy>(w_new);
    };
    cuda::for_each_group<N, 2>(
        chunk.length, vectorized,
        [&]<int U>(int i, int stride, bool vec) {
          W wr[U][N];
          int16_t rr[U][N];
          M mr[U][N], vr[U][N];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            load<N>(wr[u], w + i + u * stride, vec);
            if constexpr (kRemainder) load<N>(rr[u], rem + i + u * stride, vec);
            load<N>(mr[u], m + i + u * stride, vec);
            load<N>(vr[u], v + i + u * stride, vec);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            [[maybe_unused]] std::conditional_t<kCopy, Copy, char> cr[N];
            [[maybe_unused]] std::conditional_t<kUpdate, Update, char> ur[N];
            bool any_marked = false;
#pragma unroll
            for (int k = 0; k < N; ++k) {
              const C w_old = master_of<C, kRemainder>(wr[u][k], kRemainder ? rr[u][k] : int16_t{0});
              any_marked |= signbit(cuda::to_compute<C>(vr[u][k]));
              const C w_new = element(w_old, mr[u][k], vr[u][k], step, c);
              write(wr[u][k], rr[u][k], w_old, w_new, kCopy ? &cr[k] : nullptr, kUpdate ? &ur[k] : nullptr);
            }
            const int at = i + u * stride;
            if constexpr (kUpdate) store<N>(delta + at, ur, vec);
            else store<N>(w + at, wr[u], vec);
            if constexpr (kRemainder) store<N>(rem + at, rr[u], vec);
            if constexpr (kCopy) store<N>(copy + at, cr, vec);
            if (any_marked) store<N>(v + at, vr[u], vec);  // rare: clear the marks
          }
        },
        [&](int j) {
          int16_t unused = 0;
          int16_t& rj = kRemainder ? rem[j] : unused;
          const C w_old = master_of<C, kRemainder>(w[j], rj);
          const C w_new = element(w_old, m[j], v[j], step, c);
          write(w[j], rj, w_old, w_new, kCopy ? copy + j : nullptr, kUpdate ? delta + j : nullptr);
        });
  }
};

__global__ void finish_step_kernel(LambLaunch launch) {
  if (step_enabled(launch) && launch.inputs.split.pass != LambPass::first) ++*launch.inputs.step_device;
}

template <class W, class M, class Copy>
void launch_update(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  if (l.update_list < 0) return cuda::launch_multi_tensor(plan, UpdatePass<W, M, Copy, None, false>{l}, stream);
  if constexpr (std::is_same_v<W, double>) {
    cuda::launch_multi_tensor(plan, UpdatePass<W, M, Copy, double, false>{l}, stream);
  } else {
    cuda::launch_multi_tensor(plan, UpdatePass<W, M, Copy, float, false>{l}, stream);
  }
}

void launch_ratios(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  const cuda::PlanArgs args = cuda::plan_args(plan);
  const auto blocks = static_cast<unsigned>((plan.num_tensors() + kRatioWarps - 1) / kRatioWarps);
  ratios_kernel<<<blocks, 32 * kRatioWarps, 0, cuda::native(stream)>>>(args, l);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

// 8- or 4-bit moments: the passes of cuda/lamb_low_bit.cu around the same ratio kernel.
void launch_all_low_bit(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  const LambPass pass = l.inputs.split.pass;
  if (pass != LambPass::second) lamb_low_bit_norms_cuda(plan, l, stream);
  launch_ratios(plan, l, stream);
  if (pass != LambPass::first) lamb_low_bit_update_cuda(plan, l, stream);
}

// Float moments: W f32 or f64, or uint16_t (the bits of bf16 weights) with
// their remainders, which take neither a copy nor an update list.
template <class W, class G, class M>
void launch_all(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  using NW = native_t<W>;
  using NM = native_t<M>;
  constexpr bool kRemainder = std::is_same_v<W, uint16_t>;
  const LambPass pass = l.inputs.split.pass;
  if (pass != LambPass::second) {
    cuda::launch_multi_tensor(plan, NormsPass<NW, native_t<G>, NM, kRemainder>{l}, stream);
  }
  launch_ratios(plan, l, stream);
  if (pass == LambPass::first) return;
  if constexpr (kRemainder) {
    cuda::launch_multi_tensor(plan, UpdatePass<NW, NM, None, None, true>{l}, stream);
  } else if (l.copy_list < 0) {
    launch_update<NW, NM, None>(plan, l, stream);
  } else if (plan.dtype(l.copy_list) == DType::f16) {
    launch_update<NW, NM, __half>(plan, l, stream);
  } else {
    launch_update<NW, NM, __nv_bfloat16>(plan, l, stream);
  }
}

}  // namespace

void lamb_cuda(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  cuda::DeviceGuard guard(plan.device().index);
  if (!plan.empty()) {
    if (plan.dtype(0) == DType::f64) {
      launch_all<double, double, double>(plan, l, stream);
    } else if (l.absmax_list >= 0) {
      launch_all_low_bit(plan, l, stream);
    } else {
      dispatch_dtype(plan.dtype(1), [&]<class G>() {
        dispatch_dtype(plan.dtype(2), [&]<class M>() {
          if constexpr (!std::is_same_v<G, double> && (std::is_same_v<M, float> || std::is_same_v<M, bfloat16>)) {
            if (l.remainder_list >= 0) launch_all<uint16_t, G, M>(plan, l, stream);
            else launch_all<float, G, M>(plan, l, stream);
          }
        });
      });
    }
  }
  if (l.inputs.step_device != nullptr) {
    finish_step_kernel<<<1, 1, 0, cuda::native(stream)>>>(l);
    GRADKIT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace gradkit::spec
