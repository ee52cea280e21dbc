// LAMB's two passes over 8-bit blockwise moments (backend/lamb_blockwise.h),
// as functors of the multi-tensor driver; the ratio kernel between them is
// cuda/lamb.cu's. Pass 1: a warp owns one 256-element block at a time (8
// consecutive elements per lane), decodes, updates and encodes its moments,
// and sums w^2 and d^2 over the block (each lane its elements in order,
// then the warp's tree); thread 0 adds the chunk's block sums in block
// order. The CPU (cpu/lamb_8bit.h) adds in the same order: the same bits.
#include <cstdint>
#include <type_traits>

#include "backend/lamb.h"
#include "backend/lamb_blockwise.h"
#include "cuda/block_reduce.cuh"
#include "cuda/blockwise_lanes.cuh"
#include "cuda/lamb_launch.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::backend {
namespace {

using cuda::kLanes;
using cuda::kPerLane;
using cuda::load_lane;
using cuda::native_t;
using cuda::PlanArgs;
using cuda::store_lane;

static_assert(kPerLane == kLaneElements && kLanes == kWarpLanes, "the CPU's order must be the warp's");
constexpr int kChunkBlocks = static_cast<int>(MultiTensorPlan::kDefaultChunkElements / kQuantBlock);

struct None {};

template <class G>
struct Norms8bitOp {
  LambLaunch launch;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    if (!cuda::step_enabled(launch)) return;
    __shared__ QuantTables tables;
    __shared__ double block_w2[kChunkBlocks], block_d2[kChunkBlocks];
    cuda::copy_tables(tables, launch.tables);
    const LambCoefficients<float> c = cuda::block_coefficients<float>(plan, chunk, launch);  // synchronizes

    const float* w = plan.tensor<float>(0, chunk);
    const G* g = plan.tensor<G>(1, chunk);
    uint8_t* qm = plan.tensor<uint8_t>(2, chunk);
    uint8_t* qv = plan.tensor<uint8_t>(3, chunk);
    float* absmax_m = plan.block_tensor<float>(launch.absmax_list, chunk, kQuantBlock);
    float* absmax_v = plan.block_tensor<float>(launch.absmax_list + 1, chunk, kQuantBlock);
    const bool vectorized = cuda::vector_aligned<kPerLane>(w) && cuda::vector_aligned<kPerLane>(g) &&
                            cuda::vector_aligned<kPerLane>(qm) && cuda::vector_aligned<kPerLane>(qv);

    const int lane = threadIdx.x % kLanes;
    cuda::for_each_warp_block(chunk.length, [&](int b, int at, int n) {
      float wr[kPerLane];
      G gr[kPerLane];
      uint8_t mr[kPerLane], vr[kPerLane];
      load_lane(wr, w + at, n, vectorized);
      load_lane(gr, g + at, n, vectorized);
      load_lane(mr, qm + at, n, vectorized);
      load_lane(vr, qv + at, n, vectorized);
      const float old_m = absmax_m[b], old_v = absmax_v[b];

      float m_new[kPerLane], v_new[kPerLane];
      float amax_m = 0.0f, amax_v = 0.0f;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        lamb_8bit_moments(cuda::to_compute<float>(gr[k]), mr[k], vr[k], old_m, old_v, tables, c, m_new[k], v_new[k]);
        if (k < n) {
          amax_m = absmax_fold(amax_m, m_new[k]);
          amax_v = absmax_fold(amax_v, v_new[k]);
        }
      }
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset /= 2) {
        amax_m = absmax_fold(amax_m, __shfl_xor_sync(0xffffffffu, amax_m, offset));
        amax_v = absmax_fold(amax_v, __shfl_xor_sync(0xffffffffu, amax_v, offset));
      }
      const float scale_m = quant_scale(amax_m), scale_v = quant_scale(amax_v);
      uint8_t mq[kPerLane], vq[kPerLane];
      double w2 = 0, d2 = 0;
      bool lane_finite = true;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        mq[k] = quantize(tables.table[0], exact::mul(m_new[k], scale_m));
        vq[k] = quantize(tables.table[1], exact::mul(v_new[k], scale_v));
        if (k < n) {
          const float d = lamb_8bit_direction(wr[k], mq[k], vq[k], amax_m, amax_v, tables, c);
          lane_finite = lane_finite && finite(d);
          w2 += static_cast<double>(wr[k]) * wr[k];
          d2 += static_cast<double>(d) * d;
        }
      }
      const bool all_finite = __all_sync(0xffffffffu, lane_finite);
      w2 = cuda::warp_reduce(w2, cuda::Plus{});
      d2 = cuda::warp_reduce(d2, cuda::Plus{});
      if (all_finite) {
        store_lane(qm + at, mq, n, vectorized);
        store_lane(qv + at, vq, n, vectorized);
      }
      if (lane == 0) {
        if (all_finite) {
          absmax_m[b] = amax_m;
          absmax_v[b] = amax_v;
        } else {
          absmax_m[b] = lamb_flip_mark(old_m);
        }
        block_w2[b] = w2;
        block_d2[b] = all_finite ? d2 : 0.0;
      }
    });
    __syncthreads();
    if (threadIdx.x == 0) {
      double w2 = 0, d2 = 0;
      for (int b = 0; b * kQuantBlock < chunk.length; ++b) {
        w2 += block_w2[b];
        d2 += block_d2[b];
      }
      launch.partials[2 * blockIdx.x] = w2;  // one block per chunk: blockIdx.x is the chunk
      launch.partials[2 * blockIdx.x + 1] = d2;
    }
  }
};

template <class Copy, class Update>
struct Update8bitOp {
  static constexpr bool kCopy = !std::is_same_v<Copy, None>;
  static constexpr bool kUpdate = !std::is_same_v<Update, None>;
  LambLaunch launch;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    if (!cuda::step_enabled(launch)) return;
    __shared__ QuantTables tables;
    cuda::copy_tables(tables, launch.tables);
    const LambCoefficients<float> c = cuda::block_coefficients<float>(plan, chunk, launch);  // synchronizes
    const float step = exact::mul(c.eta, launch.ratios[chunk.tensor]);
    float* w = plan.tensor<float>(0, chunk);
    const uint8_t* qm = plan.tensor<uint8_t>(2, chunk);
    const uint8_t* qv = plan.tensor<uint8_t>(3, chunk);
    float* absmax_m = plan.block_tensor<float>(launch.absmax_list, chunk, kQuantBlock);
    const float* absmax_v = plan.block_tensor<float>(launch.absmax_list + 1, chunk, kQuantBlock);
    for (int i = threadIdx.x; i < chunk.length; i += blockDim.x) {
      const int b = i / kQuantBlock;
      const float w_old = w[i];
      const float w_new = lamb_marked(absmax_m[b])
                              ? w_old
                              : lamb_8bit_update(w_old, qm[i], qv[i], absmax_m[b], absmax_v[b], tables, step, c);
      if constexpr (kUpdate) plan.tensor<float>(launch.update_list, chunk)[i] = w_new - w_old;
      else w[i] = w_new;
      if constexpr (kCopy) plan.tensor<Copy>(launch.copy_list, chunk)[i] = cuda::from_compute<Copy>(w_new);
    }
    __syncthreads();  // every mark read before any is cleared
    const int blocks = (chunk.length + kQuantBlock - 1) / kQuantBlock;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
      if (lamb_marked(absmax_m[b])) absmax_m[b] = lamb_flip_mark(absmax_m[b]);
    }
  }
};

template <class Copy>
void launch_update(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  if (l.update_list >= 0) cuda::launch_multi_tensor(plan, Update8bitOp<Copy, float>{l}, stream);
  else cuda::launch_multi_tensor(plan, Update8bitOp<Copy, None>{l}, stream);
}

}  // namespace

void lamb_8bit_norms_cuda(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  dispatch_dtype(plan.dtype(1), [&]<class G>() {
    if constexpr (!std::is_same_v<G, double>) cuda::launch_multi_tensor(plan, Norms8bitOp<native_t<G>>{l}, stream);
  });
}

void lamb_8bit_update_cuda(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  if (l.copy_list < 0) return launch_update<None>(plan, l, stream);
  if (plan.dtype(l.copy_list) == DType::f16) launch_update<__half>(plan, l, stream);
  else launch_update<__nv_bfloat16>(plan, l, stream);
}

}  // namespace gradkit::backend
