// LAMB's two passes over 8- or 4-bit blockwise moments (spec/
// lamb_low_bit.h), as functors of the multi-tensor driver; the ratio kernel
// between them is cuda/lamb.cu's. Pass 1: a block's lanes (a warp for a
// 256-element 8-bit block, a half-warp for a 128-element 4-bit one; 8
// consecutive elements per lane) decode, update and encode its moments, and
// sum w^2 and d^2 over the block (each lane its elements in order, then the
// lanes' tree); thread 0 adds the chunk's block sums in block order. The CPU
// (cpu/lamb_low_bit.h) adds in the same order: the same bits. The forms
// differ only in their Codec (cuda/low_bit_codecs.cuh).
#include <cstdint>
#include <type_traits>

#include "spec/lamb.h"
#include "spec/lamb_low_bit.h"
#include "cuda/block_reduce.cuh"
#include "cuda/low_bit_codecs.cuh"
#include "cuda/low_bit_lanes.cuh"
#include "cuda/denominator_lanes.cuh"
#include "cuda/lamb_launch.cuh"
#include "cuda/lamb_low_bit_tuning.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/types.cuh"

namespace gradkit::spec {
namespace {

using cuda::Codec4;
using cuda::Codec8;
using cuda::kLanes;
using cuda::kPerLane;
using cuda::load_lane;
using cuda::native_t;
using cuda::PlanArgs;
using cuda::store_lane;

static_assert(kPerLane == kLaneElements && kLanes == kWarpLanes, "the CPU's order must be the lanes'");

struct None {};

// What the direction needs of a lane's stored moments, in both passes: m
// decoded from its codes, and the reciprocals of sqrt(v) + folded eps with v
// decoded from its (a lane's under one range test: cuda/denominator_lanes.cuh).
template <class Tables, class MCodes, class VCodes>
__device__ __forceinline__ void stored_moments(const Tables& tables, const MCodes& qm, const VCodes& qv, float absmax_m,
                                               float absmax_v, float folded_eps, float (&m)[kPerLane],
                                               float (&reciprocal)[kPerLane]) {
  float v[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    m[k] = decoded(tables.table[0], qm[k], absmax_m);
    v[k] = decoded(tables.table[1], qv[k], absmax_v);
  }
  cuda::denominator_reciprocal_lane(v, folded_eps, reciprocal);
}

template <class Codec, class G>
struct NormsLowBitOp {
  using Tables = typename Codec::Tables;
  static constexpr int kChunkBlocks = static_cast<int>(MultiTensorPlan::kDefaultChunkElements / Codec::kBlock);
  static constexpr int kCodeBytes = Codec::kCodeBytes;
  // Pass 1's entry of the tuning table (cuda/lamb_low_bit_tuning.cuh, which
  // says what each sets and why): the launch constants the driver reads
  // (kBlockThreads, kMinBlocks: cuda/multi_tensor.cuh) and how many of its
  // spans ahead a warp asks L2 for (prefetch_l2).
  static constexpr int kBlockThreads = cuda::kLambLowBitNorms.block_threads;
  static constexpr int kMinBlocks = cuda::kLambLowBitNorms.min_blocks;
  static constexpr int kPrefetchAhead = cuda::kLambLowBitNorms.prefetch_ahead;
  LambLaunch launch;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    if (!cuda::step_enabled(launch)) return;
    __shared__ Tables tables;
    __shared__ double block_w2[kChunkBlocks], block_d2[kChunkBlocks];
    cuda::copy_tables(tables, Codec::tables(launch));
    const LambCoefficients<float> c = cuda::block_coefficients<float>(plan, chunk, launch);  // synchronizes

    const float* w = plan.tensor<float>(0, chunk);
    const G* g = plan.tensor<G>(1, chunk);
    uint8_t* qm = plan.block_tensor<uint8_t>(2, chunk, Codec::kCodesPerByte);
    uint8_t* qv = plan.block_tensor<uint8_t>(3, chunk, Codec::kCodesPerByte);
    float* absmax_m = plan.block_tensor<float>(launch.absmax_list, chunk, Codec::kBlock);
    float* absmax_v = plan.block_tensor<float>(launch.absmax_list + 1, chunk, Codec::kBlock);
    const bool vectorized = cuda::vector_aligned<kPerLane>(w) && cuda::vector_aligned<kPerLane>(g) &&
                            cuda::vector_aligned<kCodeBytes>(qm) && cuda::vector_aligned<kCodeBytes>(qv);

    const int lane = threadIdx.x % kLanes;
    // The lanes of this lane's block, as a mask of the warp's.
    constexpr unsigned kBlockMask = Codec::kLanesPerBlock == kLanes ? 0xffffffffu : (1u << Codec::kLanesPerBlock) - 1;
    const unsigned block_lanes = kBlockMask << (lane / Codec::kLanesPerBlock * Codec::kLanesPerBlock);
    const auto prefetch = [&](int later) { cuda::prefetch_span<Codec>(later, w, g, qm, qv); };
    // The spans that lie whole in the chunk, when every list is aligned, in
    // a loop of their own (cuda::for_each_warp_block): there every element
    // is the lane's and every access a vector one, with no test left of
    // either.
    const int whole_spans = vectorized ? chunk.length / kQuantBlock : 0;
    cuda::for_each_warp_block(chunk.length, whole_spans, kPrefetchAhead, prefetch, [&](int span, int at, int count,
                                                                                     auto whole) {
      constexpr bool kWhole = decltype(whole)::value;
      const int n = kWhole ? kPerLane : count;
      const bool vector = kWhole || vectorized;
      // The lane's quantization block: the warp's (8-bit), or its half's (4-bit).
      const int b = span * (kQuantBlock / Codec::kBlock) + lane / Codec::kLanesPerBlock;
      // 4-bit: a short span's second half may not be in the chunk.
      const bool block_in_chunk = kWhole || b * Codec::kBlock < chunk.length;
      float wr[kPerLane], gr[kPerLane];
      typename Codec::Codes mr, vr;
      load_lane(wr, w + at, n, vector);
      cuda::load_lane_f32(gr, g + at, n, vector);
      cuda::load_codes<Codec>(mr, qm, at, n, vector);
      cuda::load_codes<Codec>(vr, qv, at, n, vector);
      const float old_m = block_in_chunk ? absmax_m[b] : 0.0f, old_v = block_in_chunk ? absmax_v[b] : 0.0f;

      float m_new[kPerLane], v_new[kPerLane];
      float amax_m = 0.0f, amax_v = 0.0f;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        lamb_blockwise_moments(gr[k], mr[k], vr[k], old_m, old_v, tables, c, m_new[k], v_new[k]);
        if (k < n) {
          amax_m = absmax_fold(amax_m, m_new[k]);
          amax_v = absmax_fold(amax_v, v_new[k]);
        }
      }
      // xor offsets below kLanesPerBlock stay within the block's lanes; each
      // lane ends with the block's value, lane 0 of the block with the CPU's
      // tree order (spec::warp_tree_sum).
#pragma unroll
      for (int offset = Codec::kLanesPerBlock / 2; offset > 0; offset /= 2) {
        amax_m = absmax_fold(amax_m, __shfl_xor_sync(0xffffffffu, amax_m, offset));
        amax_v = absmax_fold(amax_v, __shfl_xor_sync(0xffffffffu, amax_v, offset));
      }
      const float scale_m = quant_scale(amax_m), scale_v = quant_scale(amax_v);
      uint32_t mq[kPerLane], vq[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        mq[k] = Codec::encode(tables, 0, exact::mul(m_new[k], scale_m));
        vq[k] = Codec::encode(tables, 1, exact::mul(v_new[k], scale_v));
      }
      // The direction from the stored moments (the folded form).
      float m_stored[kPerLane], reciprocal[kPerLane];
      stored_moments(tables, mq, vq, amax_m, amax_v, c.folded_eps, m_stored, reciprocal);
      double w2 = 0, d2 = 0;
      bool lane_finite = true;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        if (k < n) {
          const float d = lamb_direction_folded(wr[k], m_stored[k], reciprocal[k], c);
          lane_finite = lane_finite && finite(d);
          w2 += static_cast<double>(wr[k]) * wr[k];
          d2 += static_cast<double>(d) * d;
        }
      }
      const bool all_finite = (__ballot_sync(0xffffffffu, lane_finite) & block_lanes) == block_lanes;
#pragma unroll
      for (int offset = Codec::kLanesPerBlock / 2; offset > 0; offset /= 2) {
        w2 += __shfl_xor_sync(0xffffffffu, w2, offset);
        d2 += __shfl_xor_sync(0xffffffffu, d2, offset);
      }
      if (all_finite) {
        cuda::store_codes<Codec>(qm, at, mq, n, vector);
        cuda::store_codes<Codec>(qv, at, vq, n, vector);
      }
      if (lane % Codec::kLanesPerBlock == 0 && block_in_chunk) {
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
      for (int b = 0; b * Codec::kBlock < chunk.length; ++b) {
        w2 += block_w2[b];
        d2 += block_d2[b];
      }
      launch.partials[2 * blockIdx.x] = w2;  // one block per chunk: blockIdx.x is the chunk
      launch.partials[2 * blockIdx.x + 1] = d2;
    }
  }
};

// Pass 2: lane k of a block's lanes updates the block's elements k * 8 to
// k * 8 + 7 (each element on its own: no order to keep), its codes and
// weights in vector loads where the chunk allows.
template <class Codec, class Copy, class Update>
struct UpdateLowBitOp {
  static constexpr bool kCopy = !std::is_same_v<Copy, None>;
  static constexpr bool kUpdate = !std::is_same_v<Update, None>;
  static constexpr int kCodeBytes = Codec::kCodeBytes;
  // Pass 2's entry of the tuning table (cuda/lamb_low_bit_tuning.cuh): the
  // launch constants the driver reads.
  static constexpr int kBlockThreads = cuda::kLambLowBitUpdate.block_threads;
  static constexpr int kMinBlocks = cuda::kLambLowBitUpdate.min_blocks;
  LambLaunch launch;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    if (!cuda::step_enabled(launch)) return;
    __shared__ typename Codec::Tables tables;
    cuda::copy_tables(tables, Codec::tables(launch));
    const LambCoefficients<float> c = cuda::block_coefficients<float>(plan, chunk, launch);  // synchronizes
    const float step = exact::mul(c.eta, launch.ratios[chunk.tensor]);
    float* w = plan.tensor<float>(0, chunk);
    const uint8_t* qm = plan.block_tensor<uint8_t>(2, chunk, Codec::kCodesPerByte);
    const uint8_t* qv = plan.block_tensor<uint8_t>(3, chunk, Codec::kCodesPerByte);
    float* absmax_m = plan.block_tensor<float>(launch.absmax_list, chunk, Codec::kBlock);
    const float* absmax_v = plan.block_tensor<float>(launch.absmax_list + 1, chunk, Codec::kBlock);
    float* update = nullptr;
    if constexpr (kUpdate) update = plan.tensor<float>(launch.update_list, chunk);
    Copy* copy = nullptr;
    if constexpr (kCopy) copy = plan.tensor<Copy>(launch.copy_list, chunk);
    const bool vectorized = cuda::vector_aligned<kPerLane>(w) && cuda::vector_aligned<kCodeBytes>(qm) &&
                            cuda::vector_aligned<kCodeBytes>(qv) && (!kUpdate || cuda::vector_aligned<kPerLane>(update)) &&
                            (!kCopy || cuda::vector_aligned<kPerLane>(copy));
    const int lane = threadIdx.x % kLanes;
    cuda::for_each_warp_block(chunk.length, [&](int span, int at, int n) {
      if (n == 0) return;  // a short span's lanes past its end (no shuffles below)
      const int b = span * (kQuantBlock / Codec::kBlock) + lane / Codec::kLanesPerBlock;
      const float block_m = absmax_m[b];
      // A marked block keeps its weights: nothing to write but the update
      // (0) or the copy, if the launch has them.
      const bool marked = lamb_marked(block_m);
      if (marked && !kUpdate && !kCopy) return;
      float wr[kPerLane], w_new[kPerLane];
      load_lane(wr, w + at, n, vectorized);
      if (marked) {
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) w_new[k] = wr[k];
      } else {
        const float block_v = absmax_v[b];
        typename Codec::Codes mr, vr;
        cuda::load_codes<Codec>(mr, qm, at, n, vectorized);
        cuda::load_codes<Codec>(vr, qv, at, n, vectorized);
        float m_stored[kPerLane], reciprocal[kPerLane];
        stored_moments(tables, mr, vr, block_m, block_v, c.folded_eps, m_stored, reciprocal);
#pragma unroll
        for (int k = 0; k < kPerLane; ++k)
          w_new[k] = lamb_low_bit_apply(wr[k], step, lamb_direction_folded(wr[k], m_stored[k], reciprocal[k], c));
      }
      float out[kPerLane];
      [[maybe_unused]] std::conditional_t<kCopy, Copy, char> cr[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        if constexpr (kUpdate) out[k] = w_new[k] - wr[k];
        else out[k] = w_new[k];
        if constexpr (kCopy) cr[k] = cuda::from_compute<Copy>(w_new[k]);
      }
      store_lane(kUpdate ? update + at : w + at, out, n, vectorized);
      if constexpr (kCopy) store_lane(copy + at, cr, n, vectorized);
    });
    __syncthreads();  // every mark read before any is cleared
    const int blocks = (chunk.length + Codec::kBlock - 1) / Codec::kBlock;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
      if (lamb_marked(absmax_m[b])) absmax_m[b] = lamb_flip_mark(absmax_m[b]);
    }
  }
};

template <class Codec, class Copy>
void launch_update(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  if (l.update_list >= 0) cuda::launch_multi_tensor(plan, UpdateLowBitOp<Codec, Copy, float>{l}, stream);
  else cuda::launch_multi_tensor(plan, UpdateLowBitOp<Codec, Copy, None>{l}, stream);
}

template <class Codec>
void launch_norms(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  dispatch_dtype(plan.dtype(1), [&]<class G>() {
    if constexpr (!std::is_same_v<G, double>) {
      cuda::launch_multi_tensor(plan, NormsLowBitOp<Codec, native_t<G>>{l}, stream);
    }
  });
}

template <class Codec>
void launch_updates(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  if (l.copy_list < 0) return launch_update<Codec, None>(plan, l, stream);
  if (plan.dtype(l.copy_list) == DType::f16) launch_update<Codec, __half>(plan, l, stream);
  else launch_update<Codec, __nv_bfloat16>(plan, l, stream);
}

}  // namespace

void lamb_low_bit_norms_cuda(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  if (l.moment_bits == 4) launch_norms<Codec4>(plan, l, stream);
  else launch_norms<Codec8>(plan, l, stream);
}

void lamb_low_bit_update_cuda(const MultiTensorPlan& plan, const LambLaunch& l, Stream stream) {
  if (l.moment_bits == 4) launch_updates<Codec4>(plan, l, stream);
  else launch_updates<Codec8>(plan, l, stream);
}

}  // namespace gradkit::spec
