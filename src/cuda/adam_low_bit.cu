// The Adam update with 8- or 4-bit blockwise moments, as a functor of the
// multi-tensor driver: one pass that decodes m and v, updates w, m and v in
// f32 (backend/adam_math.h, its folded form, with the gradient times the
// scale's reciprocal), finds each block's new absmax and encodes m and v
// again (backend/blockwise_math.h, blockwise4_math.h). A warp owns 256
// consecutive elements at a time, 8 per lane: one 8-bit block, or two 4-bit
// blocks (a half-warp each); it reduces a block's absmax with shuffles. A
// chunk (64K elements) holds whole blocks, so a thread block never shares a
// quantization block with another. What differs between the two forms (the
// tables, where a lane's codes lie, the blocks per warp) is the Codec
// (cuda/blockwise_codecs.cuh).
#include <cstdint>
#include <type_traits>

#include "backend/adam.h"
#include "backend/adam_math.h"
#include "backend/blockwise4_math.h"
#include "backend/blockwise_math.h"
#include "backend/master_math.h"
#include "cuda/adam_launch.cuh"
#include "cuda/blockwise_codecs.cuh"
#include "cuda/blockwise_lanes.cuh"
#include "cuda/master_lanes.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/sqrt_lanes.cuh"
#include "cuda/types.cuh"

namespace gradkit::backend {
namespace {

using cuda::Codec4;
using cuda::Codec8;
using cuda::native_t;
using cuda::NoCopy;
using cuda::PlanArgs;
using cuda::kLanes;
using cuda::kPerLane;
using cuda::load_bits;
using cuda::load_lane_f32;
using cuda::store_bits;
using cuda::store_lane;

// The update's flags for one chunk: the decay rule fixed at compile time
// (one copy of the block loop per rule, picked per chunk, since groups may
// differ), so that no element computes the other rules' operations under
// predicates; maximize read at run time (one select); no amsgrad (8- and
// 4-bit moments refuse it: gradkit/ops/adam.h).
template <WeightDecay Decay>
struct FlagsLowBit {
  static constexpr int32_t decay = static_cast<int32_t>(Decay);
  static constexpr bool amsgrad = false;
  bool maximize;
};

// W: f32, or the bits of bf16 weights (uint16_t) with kRemainder.
template <class Codec, class W, class G, class Copy, bool kRemainder>
struct AdamLowBitOp {
  using Tables = typename Codec::Tables;
  static constexpr bool kCopy = !std::is_same_v<Copy, NoCopy>;
  // The 8-bit forms: three blocks of 256 threads per multiprocessor, 80
  // registers, where those without a model copy spill nothing (ptxas; with
  // f32 gradients and a remainder 16 bytes, with a copy up to 24); two
  // blocks of 512 held them to 64 registers with 12 to 100 bytes spilled.
  // The 4-bit forms: two blocks of 512, 64 registers (the f32-weights form
  // spills 4 bytes there, the remainder form 108, and still ran faster than
  // at 80 registers). One block of 512 (16 warps, each owning one
  // quantization block at a time) left the memory system idle between their
  // loads (Nsight Compute: 25% occupancy, DRAM 20% busy). Measured on an H100 over the GPT-2 list, in
  // interleaved rounds (bench/RESULTS.md, 2026-11-26, the block-size sweep):
  // at 256 x 3 against 512 x 2, 8-bit 82.5% of copy over its floor against
  // 81.8%, 8-bit remainder 75.2% against 68.4%; 4-bit 84.4% against 85.5%,
  // 4-bit remainder 62.5% against 63.8%. In an earlier sweep, 384 x 2,
  // 128 x 5 and 256 x 2 were slower than 256 x 3 in every form.
  static constexpr bool kEightBit = std::is_same_v<Codec, Codec8>;
  static constexpr int kBlockThreads = kEightBit ? 256 : 512;
  static constexpr int kMinBlocks = kEightBit ? 3 : 2;
  // How many of its blocks ahead a warp asks L2 for (prefetch_l2), per form.
  // Before the codes and halves stayed in their words, one block ahead helped
  // every form (bench/RESULTS.md, 2026-11-26 and 2026-11-27). With them
  // (2026-11-27, third session, the prefetch sweep; % of copy over each floor,
  // one block ahead against none): 8-bit 81.8% against 74.6%, 8-bit remainder
  // 78.0% against 84.8%, 4-bit 89.7% against 93.9%, 4-bit remainder 84.7%
  // against 82.8%. Then with the 8-bit form at one thread block a chunk
  // (below): 8-bit 85.7% against 90.2% without.
  static constexpr int kPrefetch8Bit = 0;
  static constexpr int kPrefetch8BitRemainder = 0;
  static constexpr int kPrefetch4Bit = 0;
  static constexpr int kPrefetch4BitRemainder = 1;
  static constexpr int kPrefetchAhead = kEightBit ? (kRemainder ? kPrefetch8BitRemainder : kPrefetch8Bit)
                                                  : (kRemainder ? kPrefetch4BitRemainder : kPrefetch4Bit);
  // Thread blocks per chunk (cuda/multi_tensor.cuh), each on whole warp spans,
  // per form. Before the words change, two parts helped the forms with f32
  // weights and cost the remainder forms (bench/RESULTS.md, 2026-11-26 run 3,
  // 2026-11-27). After it (2026-11-27, third session, the chunk sweep; % of
  // copy over each floor at 1, 2 and 4 parts, the prefetch as above): 8-bit
  // 85.8%, 81.5%, 81.4%; 8-bit remainder 84.9% at 1, 81.3% at 4; 4-bit 90.1%,
  // 94.2%, 95.8%; 4-bit remainder 84.6% at 1, 85.6% at 4.
  // Whether whole spans are read and written in quads (cuda::LaneSpan), in
  // a loop of their own, per form. On an H200 (bench/RESULTS.md, 2026-11-27,
  // fifth session; % of copy over each floor, quads against 8 consecutive
  // elements a lane, both with the loop of their own): int4 86.2% against
  // 77.3%, int4 remainder 76.1% against 71.9%; int8 70.1% against 79.0%,
  // int8 remainder 64.7% against 67.1%. The 8-bit forms keep one loop, whose
  // remainder form the second loop cost 5.8% (72.1% with one).
  static constexpr bool kQuads8Bit = false;
  static constexpr bool kQuads4Bit = true;
  static constexpr bool kQuads = kEightBit ? kQuads8Bit : kQuads4Bit;
  static constexpr int kChunkParts8Bit = 1;
  static constexpr int kChunkParts4Bit = 4;
  static constexpr int kChunkParts = kEightBit ? kChunkParts8Bit : kChunkParts4Bit;
  static constexpr int kPartAlign = kQuantBlock;
  AdamLaunch launch;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    const AdamStepInputs& in = launch.inputs;
    if (in.found_inf != nullptr && *in.found_inf) return;

    // The group's constants and both code tables, once per thread block.
    __shared__ AdamCoefficients<float> shared;
    __shared__ Tables tables;
    if (threadIdx.x == 0) shared = cuda::chunk_coefficients<float>(plan, chunk, launch);
    cuda::copy_tables(tables, Codec::tables(launch));
    __syncthreads();
    const AdamCoefficients<float> c = shared;
    const float scale = in.grad_scale_device != nullptr ? *in.grad_scale_device : in.grad_scale;
    const float inverse_scale = 1.0f / scale;
    switch (static_cast<WeightDecay>(c.decay)) {
      case WeightDecay::l2: return update(plan, chunk, c, FlagsLowBit<WeightDecay::l2>{c.maximize}, scale, inverse_scale, tables);
      case WeightDecay::decoupled:
        return update(plan, chunk, c, FlagsLowBit<WeightDecay::decoupled>{c.maximize}, scale, inverse_scale, tables);
      case WeightDecay::hugging_face: break;
    }
    update(plan, chunk, c, FlagsLowBit<WeightDecay::hugging_face>{c.maximize}, scale, inverse_scale, tables);
  }

  template <class Flags>
  __device__ __forceinline__ void update(const PlanArgs& plan, const PlanChunk& chunk, const AdamCoefficients<float>& c,
                                         Flags flags, float scale, float inverse_scale, const Tables& tables) const {
    W* w = plan.tensor<W>(0, chunk);
    const G* g = plan.tensor<G>(1, chunk);
    uint8_t* qm = plan.block_tensor<uint8_t>(2, chunk, Codec::kCodesPerByte);
    uint8_t* qv = plan.block_tensor<uint8_t>(3, chunk, Codec::kCodesPerByte);
    float* absmax_m = plan.block_tensor<float>(launch.absmax_list, chunk, Codec::kBlock);
    float* absmax_v = plan.block_tensor<float>(launch.absmax_list + 1, chunk, Codec::kBlock);
    Copy* copy = nullptr;
    if constexpr (kCopy) copy = plan.tensor<Copy>(launch.copy_list, chunk);
    int16_t* rem = nullptr;
    if constexpr (kRemainder) rem = plan.tensor<int16_t>(launch.remainder_list, chunk);
    constexpr int kCodeBytes = Codec::kCodeBytes;
    const bool vectorized = cuda::vector_aligned<kPerLane>(w) && cuda::vector_aligned<kPerLane>(g) &&
                            cuda::vector_aligned<kCodeBytes>(qm) && cuda::vector_aligned<kCodeBytes>(qv) &&
                            (!kCopy || cuda::vector_aligned<kPerLane>(copy)) &&
                            (!kRemainder || cuda::vector_aligned<kPerLane>(rem));

    const int lane = threadIdx.x % kLanes;
    const auto prefetch = [&](int later) {
      cuda::prefetch_span<Codec>(later, w, g, qm, qv);
      if constexpr (kRemainder) cuda::prefetch_l2(rem + later);
    };
    // `whole`: every element of the lane's span in the chunk and every list
    // aligned for vector access; a bool, or a std::bool_constant in the
    // loops over whole spans and the rest (with kQuads).
    const auto update_span = [&](int b, int at, int n, auto whole) {
      // The masters in f32 (joined from bf16 weights and remainders, which
      // stay in their words), the gradients in f32, the codes in their words.
      float wc[kPerLane], gc[kPerLane];
      [[maybe_unused]] cuda::Halves weight_bits, remainder_bits;
      typename Codec::Codes mr, vr;
      // Every load of the span under one branch, and the stores under one
      // (two for the remainder forms, below; cuda::split_span): a branch
      // each took 3 or 4 instructions, and the compiler kept their
      // predicates as bits of a register. A whole span in quads, so that
      // each access of the warp is coalesced (cuda::LaneSpan).
      const cuda::LaneSpan span = kQuads ? cuda::codec_span<Codec>(b, at, n) : cuda::contiguous_span(at, n);
      cuda::split_span(whole, [&](bool whole) {
        if constexpr (kRemainder) {
          load_bits(weight_bits, w, span, whole);
          load_bits(remainder_bits, rem, span, whole);
        } else {
          load_lane_f32(wc, w, span, whole);
        }
        load_lane_f32(gc, g, span, whole);
        cuda::load_codes<Codec>(mr, qm, span, whole);
        cuda::load_codes<Codec>(vr, qv, span, whole);
      });
      if constexpr (kRemainder) cuda::join_lane(weight_bits, remainder_bits, wc);
      // The lane's quantization block: the warp's (8-bit), or its half's (4-bit).
      const int block = b * (kQuantBlock / Codec::kBlock) + lane / Codec::kLanesPerBlock;
      const bool block_in_chunk = block * Codec::kBlock < chunk.length;  // 4-bit: a short span's second half may not be
      const float old_m = block_in_chunk ? absmax_m[block] : 0.0f, old_v = block_in_chunk ? absmax_v[block] : 0.0f;

      float m_new[kPerLane], v_new[kPerLane];
      [[maybe_unused]] std::conditional_t<kCopy, Copy, char> cr[kPerLane];
      uint32_t amax_m = 0, amax_v = 0;  // bit patterns (absmax_bits_fold)
      // The gradient times the scale's reciprocal (the folded form: one
      // division per thread block, not per element), under a branch uniform
      // across the launch: written per element, the compiler computed the
      // product always and selected.
      if (scale != 1.0f) {
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) gc[k] = exact::mul(gc[k], inverse_scale);
      }
      // adam_element_folded in its two halves, with the lane's square roots
      // between them under one range test (cuda/sqrt_lanes.cuh).
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        m_new[k] = Codec::decode(tables, 0, mr, k, old_m);
        v_new[k] = Codec::decode(tables, 1, vr, k, old_v);
        adam_moments_folded(wc[k], gc[k], m_new[k], v_new[k], c, flags);
      }
      float root[kPerLane];
      cuda::sqrt_lane(v_new, root);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        adam_step_folded(wc[k], m_new[k], root[k], c, flags);
        if constexpr (kCopy) cr[k] = cuda::from_compute<Copy>(wc[k]);
      }
      const auto store_weights = [&](bool whole) {
        if constexpr (kRemainder) {
          store_bits(w, weight_bits, span, whole);
          store_bits(rem, remainder_bits, span, whole);
        } else {
          store_lane(w, wc, span, whole);
        }
        if constexpr (kCopy) store_lane(copy, cr, span, whole);
      };
      // The remainder forms' weights leave before the encode, which then
      // holds 8 registers fewer (they spilled, or reloaded their pointers,
      // 3 instructions an element more); the others' leave with the codes
      // (a branch of their own cost them 3 an element).
      if constexpr (kRemainder) {
        cuda::split_lane(wc, weight_bits, remainder_bits);
        cuda::split_span(whole, store_weights);
      }
      cuda::fold_lane_absmax(amax_m, m_new, n);
      cuda::fold_lane_absmax(amax_v, v_new, n);
      // The block's absmax in each of its lanes (an integer max: the order
      // of the shuffle tree does not change it; xor offsets below
      // kLanesPerBlock stay within the block's lanes).
#pragma unroll
      for (int offset = Codec::kLanesPerBlock / 2; offset > 0; offset /= 2) {
        amax_m = absmax_bits_fold(amax_m, __shfl_xor_sync(0xffffffffu, amax_m, offset));
        amax_v = absmax_bits_fold(amax_v, __shfl_xor_sync(0xffffffffu, amax_v, offset));
      }
      const float block_m = bits_float(amax_m), block_v = bits_float(amax_v);
      const float scale_m = quant_scale(block_m), scale_v = quant_scale(block_v);
      uint32_t mq[kPerLane], vq[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        mq[k] = Codec::encode(tables, 0, exact::mul(m_new[k], scale_m));
        vq[k] = Codec::encode(tables, 1, exact::mul(v_new[k], scale_v));
      }
      cuda::split_span(whole, [&](bool whole) {
        if constexpr (!kRemainder) store_weights(whole);
        cuda::store_codes<Codec>(qm, mq, span, whole);
        cuda::store_codes<Codec>(qv, vq, span, whole);
      });
      if (lane % Codec::kLanesPerBlock == 0 && block_in_chunk) {
        absmax_m[block] = block_m;
        absmax_v[block] = block_v;
      }
    };
    if constexpr (kQuads) {
      // The spans that lie whole in the chunk, when every list is aligned.
      const int whole_spans = vectorized ? chunk.length / kQuantBlock : 0;
      cuda::for_each_warp_block(chunk.length, whole_spans, kPrefetchAhead, prefetch, update_span);
    } else {
      cuda::for_each_warp_block(chunk.length, kPrefetchAhead, prefetch, [&](int b, int at, int n) {
        update_span(b, at, n, vectorized && n == kPerLane);
      });
    }
  }
};

template <class Codec>
struct MomentsLowBit {
  template <class Weights, class G, class M, class Copy>
  struct Kernel {
    static void launch(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
      constexpr bool kRemainder = std::is_same_v<Weights, cuda::RemainderWeights>;
      using W = std::conditional_t<kRemainder, uint16_t, Weights>;
      if constexpr (std::is_same_v<M, float>) {
        cuda::launch_multi_tensor(plan, AdamLowBitOp<Codec, W, native_t<G>, native_t<Copy>, kRemainder>{launch},
                                  stream);
      }
    }
  };
};

}  // namespace

void adam_8bit_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
  cuda::dispatch_adam<MomentsLowBit<Codec8>::Kernel>(plan, launch, stream);
}

void adam_4bit_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
  cuda::dispatch_adam<MomentsLowBit<Codec4>::Kernel>(plan, launch, stream);
}

}  // namespace gradkit::backend
