// The Adam update with 8- or 4-bit blockwise moments, as a functor of the
// multi-tensor driver: one pass that decodes m and v, updates w, m and v in
// f32 (spec/adam_math.h, its folded form, with the gradient times the
// scale's reciprocal), finds each block's new absmax and encodes m and v
// again (spec/low_bit_int8_math.h, low_bit_int4_math.h). A warp owns 256
// consecutive elements at a time, 8 per lane: one 8-bit block, or two 4-bit
// blocks (a half-warp each); it reduces a block's absmax with shuffles. A
// chunk (64K elements) holds whole blocks, so a thread block never shares a
// quantization block with another. What differs between the two forms (the
// tables, where a lane's codes lie, the blocks per warp) is the Codec
// (cuda/low_bit_codecs.cuh).
#include <cstdint>
#include <type_traits>

#include "spec/adam.h"
#include "spec/adam_math.h"
#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_int8_math.h"
#include "spec/master_math.h"
#include "cuda/adam_launch.cuh"
#include "cuda/adam_low_bit_tuning.cuh"
#include "cuda/low_bit_codecs.cuh"
#include "cuda/low_bit_lanes.cuh"
#include "cuda/denominator_lanes.cuh"
#include "cuda/master_lanes.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/span_stage.cuh"
#include "cuda/types.cuh"

namespace gradkit::spec {
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
  // The form's entry of the tuning table (cuda/adam_low_bit_tuning.cuh,
  // which says what each sets and why): the launch constants the driver
  // reads (kBlockThreads, kMinBlocks, kChunkParts: cuda/multi_tensor.cuh),
  // the L2 prefetch, whether whole spans go in quads (cuda::LaneSpan) in a
  // loop of their own, and whether they come through shared memory, a round
  // of spans (one a warp) at a time, copied by the copy engine one round
  // ahead (cuda/span_stage.cuh; sm_90 and later). A staged span's two
  // absmax are copied with the round into the slot (kStageAbsmax), or loaded
  // from the lists after the warp's read of the round, with the round's
  // absmax asked of L2 as the round is asked for (kPrefetchAbsmax). A block
  // keeps one slot: more bytes in flight cost these kernels, so a second
  // slot (a round asked two ahead) and L2 asks for later rounds are slower
  // (measured: bench/log/2026-11-28.md, "two staging slots a block" and "two
  // slots and L2 asked ahead").
  static constexpr bool kEightBit = std::is_same_v<Codec, Codec8>;
  static constexpr cuda::AdamLowBitTuning kTuning = cuda::adam_low_bit_tuning(kEightBit, kRemainder);
  static constexpr int kBlockThreads = kTuning.block_threads;
  static constexpr int kMinBlocks = kTuning.min_blocks;
  static constexpr int kChunkParts = kTuning.chunk_parts;
  static constexpr int kPrefetchAhead = kTuning.prefetch_ahead;
  static constexpr bool kQuads = kTuning.quads;
  static constexpr bool kStage = kTuning.stage && cuda::kCanStage;
  static constexpr bool kStageQuads = kTuning.stage_quads;
  static constexpr bool kStageAbsmax = kStage && kTuning.stage_absmax;
  static constexpr bool kPrefetchAbsmax = kTuning.prefetch_absmax;
  static constexpr int kPartAlign = kQuantBlock;
  // A staged round's lists in the block's slot, each list's spans in warp
  // order, each list at a multiple of kStageAlign: weights (f32, or bf16
  // bits then remainders), gradients, then both moments' codes.
  static constexpr int kWarps = kBlockThreads / cuda::kLanes;
  static constexpr int kWeightBytes = kQuantBlock * static_cast<int>(sizeof(W));  // a span's
  static constexpr int kRemainderBytes = kRemainder ? kQuantBlock * static_cast<int>(sizeof(int16_t)) : 0;
  static constexpr int kGradientBytes = kQuantBlock * static_cast<int>(sizeof(G));
  static constexpr int kCodeSpanBytes = kQuantBlock / Codec::kCodesPerByte;
  static constexpr int kBlocksPerSpan = kQuantBlock / Codec::kBlock;
  static constexpr int kAbsmaxBytes = kStageAbsmax ? kBlocksPerSpan * static_cast<int>(sizeof(float)) : 0;
  static constexpr int kSpanBytes = kWeightBytes + kRemainderBytes + kGradientBytes + 2 * kCodeSpanBytes + 2 * kAbsmaxBytes;
  static constexpr int kRemainderAt = kWarps * kWeightBytes;
  static constexpr int kGradientAt = kRemainderAt + kWarps * kRemainderBytes;
  static constexpr int kCodesAt = kGradientAt + kWarps * kGradientBytes;      // m's, then v's
  static constexpr int kAbsmaxAt = kCodesAt + 2 * kWarps * kCodeSpanBytes;  // m's, then v's
  static constexpr int kSlotBytes = kWarps * kSpanBytes;
  // A span's absmax are fewer bytes than the copy engine's granularity, so
  // with kStageAbsmax a round holds a multiple of kRoundSpans spans (a
  // chunk's last few whole spans are read from the lists).
  static constexpr int kRoundSpans = kStageAbsmax ? cuda::kStageAlign / kAbsmaxBytes : 1;
  static_assert(kWeightBytes % cuda::kStageAlign == 0 && kRemainderBytes % cuda::kStageAlign == 0 &&
                kGradientBytes % cuda::kStageAlign == 0 && kCodeSpanBytes % cuda::kStageAlign == 0 &&
                (kWarps * kAbsmaxBytes) % cuda::kStageAlign == 0 && kWarps % kRoundSpans == 0);
  // So that a list `vectorized` allows (kPerLane elements an access) is
  // stage_aligned: only the code lists need the test.
  static_assert((kPerLane * sizeof(W)) % cuda::kStageAlign == 0 && (kPerLane * sizeof(G)) % cuda::kStageAlign == 0 &&
                (kPerLane * sizeof(int16_t)) % cuda::kStageAlign == 0);
  struct StageMemory {
    alignas(128) uint8_t slot[kSlotBytes];
    cuda::RoundSignals signals;
  };
  struct NoStageMemory {};
  using Stage = std::conditional_t<kStage, StageMemory, NoStageMemory>;
  AdamLaunch launch;

  // Where a span's inputs are read: the lists, or the warp's slot (a staged
  // span), at `span` there.
  struct Sources {
    const W* w;
    const int16_t* rem;
    const G* g;
    const uint8_t* qm;
    const uint8_t* qv;
    cuda::LaneSpan span;
  };
  // The lane's span of block b in quads (a whole span only) or not.
  static __device__ __forceinline__ cuda::LaneSpan span_of(int b, int at, int n, bool quads) {
    return quads ? cuda::codec_span<Codec>(b, at, n) : cuda::contiguous_span(at, n);
  }

  // A chunk's lists, and whether each allows vector access (kPerLane
  // elements, a lane's codes).
  struct Lists {
    W* w;
    const G* g;
    uint8_t* qm;
    uint8_t* qv;
    float* absmax_m;
    float* absmax_v;
    Copy* copy;
    int16_t* rem;
    bool vectorized;
  };
  __device__ __forceinline__ Lists lists_of(const PlanArgs& plan, const PlanChunk& chunk) const {
    Lists l{plan.tensor<W>(0, chunk),
            plan.tensor<G>(1, chunk),
            plan.block_tensor<uint8_t>(2, chunk, Codec::kCodesPerByte),
            plan.block_tensor<uint8_t>(3, chunk, Codec::kCodesPerByte),
            plan.block_tensor<float>(launch.absmax_list, chunk, Codec::kBlock),
            plan.block_tensor<float>(launch.absmax_list + 1, chunk, Codec::kBlock),
            nullptr,
            nullptr,
            false};
    if constexpr (kCopy) l.copy = plan.tensor<Copy>(launch.copy_list, chunk);
    if constexpr (kRemainder) l.rem = plan.tensor<int16_t>(launch.remainder_list, chunk);
    constexpr int kCodeBytes = Codec::kCodeBytes;
    l.vectorized = cuda::vector_aligned<kPerLane>(l.w) && cuda::vector_aligned<kPerLane>(l.g) &&
                   cuda::vector_aligned<kCodeBytes>(l.qm) && cuda::vector_aligned<kCodeBytes>(l.qv) &&
                   (!kCopy || cuda::vector_aligned<kPerLane>(l.copy)) &&
                   (!kRemainder || cuda::vector_aligned<kPerLane>(l.rem));
    return l;
  }

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& chunk) const {
    const AdamStepInputs& in = launch.inputs;
    if (in.found_inf != nullptr && *in.found_inf) return;

    // The group's constants and both code tables, once per thread block.
    // Thread 0 asks for the chunk's first staged round before it computes
    // the constants, so that the round's loads are in flight while the
    // block sets up (measured: bench/log/2026-11-28.md, "the first round
    // asked earlier, timed").
    __shared__ AdamCoefficients<float> shared;
    __shared__ Tables tables;
    __shared__ Stage stage;
    if (threadIdx.x == 0) {
      if constexpr (kStage) {
        const cuda::RoundStage round(stage.slot, &stage.signals);
        round.init();
        const Lists l = lists_of(plan, chunk);
        const int staged = staged_spans(chunk, l);
        if (staged > 0) ask(round, l, staged, 0);
      }
      shared = cuda::chunk_coefficients<float>(plan, chunk, launch);
    }
    cuda::copy_tables(tables, Codec::tables(launch));
    __syncthreads();
    const AdamCoefficients<float> c = shared;
    const float scale = in.grad_scale_device != nullptr ? *in.grad_scale_device : in.grad_scale;
    const float inverse_scale = 1.0f / scale;
    switch (static_cast<WeightDecay>(c.decay)) {
      case WeightDecay::l2:
        return update(plan, chunk, c, FlagsLowBit<WeightDecay::l2>{c.maximize}, scale, inverse_scale, tables, stage);
      case WeightDecay::decoupled:
        return update(plan, chunk, c, FlagsLowBit<WeightDecay::decoupled>{c.maximize}, scale, inverse_scale, tables,
                      stage);
      case WeightDecay::hugging_face: break;
    }
    update(plan, chunk, c, FlagsLowBit<WeightDecay::hugging_face>{c.maximize}, scale, inverse_scale, tables, stage);
  }

  template <class Flags>
  __device__ __forceinline__ void update(const PlanArgs& plan, const PlanChunk& chunk, const AdamCoefficients<float>& c,
                                         Flags flags, float scale, float inverse_scale, const Tables& tables,
                                         Stage& stage) const {
    const Lists lists = lists_of(plan, chunk);
    W* w = lists.w;
    const G* g = lists.g;
    uint8_t* qm = lists.qm;
    uint8_t* qv = lists.qv;
    float* absmax_m = lists.absmax_m;
    float* absmax_v = lists.absmax_v;
    Copy* copy = lists.copy;
    int16_t* rem = lists.rem;
    const bool vectorized = lists.vectorized;

    const int lane = threadIdx.x % kLanes;
    const auto prefetch = [&](int later) {
      cuda::prefetch_span<Codec>(later, w, g, qm, qv);
      if constexpr (kRemainder) cuda::prefetch_l2(rem + later);
    };
    // `whole`: every element of the lane's span in the chunk and every list
    // aligned for vector access; a bool, or a std::bool_constant in the
    // loops over whole spans and the rest (with kQuads, kStage). `span`: where
    // the span's results go; `from`: where its inputs are; `after_loads`: what
    // the warp does once it has them in registers (a staged span: counts its
    // read, after which the slot may be refilled, so nothing reads `from`
    // after it: a try that read the absmax from the slot later raced);
    // `absmax(block, in_chunk, old_m, old_v)`: the lane's block's absmax.
    const auto update_span = [&](int b, int n, auto whole, const cuda::LaneSpan& span, const Sources& from,
                                 auto&& after_loads, auto&& absmax) {
      // The masters in f32 (joined from bf16 weights and remainders, which
      // stay in their words), the gradients in f32, the codes in their words.
      float wc[kPerLane], gc[kPerLane];
      [[maybe_unused]] cuda::Halves weight_bits, remainder_bits;
      typename Codec::Codes mr, vr;
      // Every load of the span under one branch, and the stores under one
      // (two for the remainder forms, below; cuda::split_span): a branch
      // each costs 3 or 4 instructions, and the compiler keeps their
      // predicates as bits of a register. A whole span in quads, so that
      // each access of the warp is coalesced (cuda::LaneSpan).
      cuda::split_span(whole, [&](bool whole) {
        if constexpr (kRemainder) {
          load_bits(weight_bits, from.w, from.span, whole);
          load_bits(remainder_bits, from.rem, from.span, whole);
        } else {
          load_lane_f32(wc, from.w, from.span, whole);
        }
        load_lane_f32(gc, from.g, from.span, whole);
        cuda::load_codes<Codec>(mr, from.qm, from.span, whole);
        cuda::load_codes<Codec>(vr, from.qv, from.span, whole);
      });
      after_loads();
      if constexpr (kRemainder) cuda::join_lane(weight_bits, remainder_bits, wc);
      // The lane's quantization block: the warp's (8-bit), or its half's (4-bit).
      const int block = b * kBlocksPerSpan + lane / Codec::kLanesPerBlock;
      const bool block_in_chunk = block * Codec::kBlock < chunk.length;  // 4-bit: a short span's second half may not be
      float old_m, old_v;
      absmax(block, block_in_chunk, old_m, old_v);

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
      // adam_element_folded in its parts, with the lane's reciprocals of
      // sqrt(v) + eps between them under one range test
      // (cuda/denominator_lanes.cuh).
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        m_new[k] = Codec::decode(tables, 0, mr, k, old_m);
        v_new[k] = Codec::decode(tables, 1, vr, k, old_v);
        adam_moments_folded(wc[k], gc[k], m_new[k], v_new[k], c, flags);
      }
      float reciprocal[kPerLane];
      cuda::denominator_reciprocal_lane(v_new, c.folded_eps, reciprocal);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        adam_step_folded(wc[k], m_new[k], reciprocal[k], c, flags);
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
    const auto nothing = [] {};
    const auto from_list_absmax = [&](int block, bool in_chunk, float& old_m, float& old_v) {
      old_m = in_chunk ? absmax_m[block] : 0.0f;
      old_v = in_chunk ? absmax_v[block] : 0.0f;
    };
    const auto from_lists = [&](const cuda::LaneSpan& span) { return Sources{w, rem, g, qm, qv, span}; };
    // The warp's first block; past the staged ones, when there are.
    int first = threadIdx.x / kLanes;
    if constexpr (kStage) {
      first = update_staged(chunk, lists, stage, update_span, from_list_absmax);
    }
    if constexpr (kQuads) {
      // The spans that lie whole in the chunk, when every list is aligned.
      const int whole_spans = vectorized ? chunk.length / kQuantBlock : 0;
      cuda::for_each_warp_block(
          chunk.length, whole_spans, kPrefetchAhead, prefetch,
          [&](int b, int at, int n, auto whole) {
            const cuda::LaneSpan span = span_of(b, at, n, kQuads);
            update_span(b, n, whole, span, from_lists(span), nothing, from_list_absmax);
          },
          first);
    } else {
      cuda::for_each_warp_block(
          chunk.length, kPrefetchAhead, prefetch,
          [&](int b, int at, int n) {
            const cuda::LaneSpan span = cuda::contiguous_span(at, n);
            update_span(b, n, vectorized && n == kPerLane, span, from_lists(span), nothing, from_list_absmax);
          },
          first);
    }
  }

  // How many of the chunk's whole spans come through the block's slot: a
  // multiple of kRoundSpans, when the lists allow vector access and the
  // copy engine (cuda::stage_aligned); the same for every thread.
  __device__ __forceinline__ int staged_spans(const PlanChunk& chunk, const Lists& l) const {
    const bool stageable = l.vectorized && cuda::stage_aligned(l.qm) && cuda::stage_aligned(l.qv) &&
                           (!kStageAbsmax || (cuda::stage_aligned(l.absmax_m) && cuda::stage_aligned(l.absmax_v)));
    return stageable ? chunk.length / kQuantBlock / kRoundSpans * kRoundSpans : 0;
  }

  // Asks for the round of spans from `first` (of `staged`): its lists'
  // parts, one copy each, into the block's slot.
  __device__ __forceinline__ void ask(const cuda::RoundStage& stage, const Lists& l, int staged, int first) const {
    const int spans = min(kWarps, staged - first), at = first * kQuantBlock;
    stage.expect(spans * kSpanBytes);
    stage.copy(0, l.w + at, spans * kWeightBytes);
    if constexpr (kRemainder) stage.copy(kRemainderAt, l.rem + at, spans * kRemainderBytes);
    stage.copy(kGradientAt, l.g + at, spans * kGradientBytes);
    stage.copy(kCodesAt, l.qm + at / Codec::kCodesPerByte, spans * kCodeSpanBytes);
    stage.copy(kCodesAt + kWarps * kCodeSpanBytes, l.qv + at / Codec::kCodesPerByte, spans * kCodeSpanBytes);
    if constexpr (kStageAbsmax) {
      stage.copy(kAbsmaxAt, l.absmax_m + first * kBlocksPerSpan, spans * kAbsmaxBytes);
      stage.copy(kAbsmaxAt + kWarps * kAbsmaxBytes, l.absmax_v + first * kBlocksPerSpan, spans * kAbsmaxBytes);
    } else if constexpr (kPrefetchAbsmax) {
      cuda::prefetch_l2(l.absmax_m + first * kBlocksPerSpan);
      cuda::prefetch_l2(l.absmax_v + first * kBlocksPerSpan);
    }
  }

  // The whole spans of the chunk through the block's slot (kStage), a round
  // of spans (one a warp: the blocks the warps own in turn; with
  // kStageAbsmax, their blocks' absmax too) at a time: thread 0 asked for
  // the first round before the block's setup (operator()); each warp reads
  // its part into registers, and the warp that reads a round last asks for
  // the next one before it computes its own. Returns the warp's first block
  // past them.
  template <class UpdateSpan, class ListAbsmax>
  __device__ __forceinline__ int update_staged(const PlanChunk& chunk, const Lists& lists, Stage& memory,
                                               UpdateSpan& update_span, ListAbsmax& from_list_absmax) const {
    const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
    const int staged = staged_spans(chunk, lists);
    int b = warp;
    if (staged == 0) return b;
    cuda::RoundStage stage(memory.slot, &memory.signals);
    for (; b < staged; b += kWarps) {
      stage.wait();
      // The warp's part of the round, at the lane's place in it, in the
      // layout its results are stored in.
      const uint8_t* slot = stage.slot();
      const Sources from{reinterpret_cast<const W*>(slot) + warp * kQuantBlock,
                         reinterpret_cast<const int16_t*>(slot + kRemainderAt) + warp * kQuantBlock,
                         reinterpret_cast<const G*>(slot + kGradientAt) + warp * kQuantBlock,
                         slot + kCodesAt + warp * kCodeSpanBytes,
                         slot + kCodesAt + (kWarps + warp) * kCodeSpanBytes,
                         span_of(0, lane * kPerLane, kPerLane, kStageQuads)};
      // The span's absmax, from the slot before the warp counts its read.
      float slot_m = 0.0f, slot_v = 0.0f;
      update_span(
          b, kPerLane, std::true_type{}, span_of(b, b * kQuantBlock + lane * kPerLane, kPerLane, kStageQuads), from,
          [&] {
            if constexpr (kStageAbsmax) {
              const float* absmax = reinterpret_cast<const float*>(slot + kAbsmaxAt);
              const int block = warp * kBlocksPerSpan + lane / Codec::kLanesPerBlock;
              slot_m = absmax[block];
              slot_v = absmax[kWarps * kBlocksPerSpan + block];
            }
            __syncwarp();
            const int next = b - warp + kWarps;  // the next round's first span
            if (lane == 0 && next < staged && stage.read_last(kWarps)) ask(stage, lists, staged, next);
          },
          [&](int block, bool in_chunk, float& old_m, float& old_v) {
            if constexpr (kStageAbsmax) {
              old_m = slot_m;
              old_v = slot_v;
            } else {
              from_list_absmax(block, in_chunk, old_m, old_v);
            }
          });
    }
    return b;
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

void adam_int8_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
  cuda::dispatch_adam<MomentsLowBit<Codec8>::Kernel>(plan, launch, stream);
}

void adam_int4_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream) {
  cuda::dispatch_adam<MomentsLowBit<Codec4>::Kernel>(plan, launch, stream);
}

}  // namespace gradkit::spec
