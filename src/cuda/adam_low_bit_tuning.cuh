// The tuning table of the low-bit Adam kernel (cuda/adam_low_bit.cu): one
// entry per form, a constexpr AdamLowBitTuning each, from which
// AdamLowBitOp takes its launch constants and its choices of loop, L2
// prefetch and staging (adam_low_bit_tuning picks a form's). LAMB's
// low-bit passes have a table of their own (cuda/lamb_low_bit_tuning.cuh):
// their knobs are not Adam's, and each kernel's source includes its own
// table alone, so that a change to one table rebuilds one object.
//
// Every value is a macro that a compile definition overrides, named
// GRADKIT_ADAM_<FORM>_<FIELD>: FORM is INT8 (8-bit moments, f32 weights),
// INT8_REMAINDER (8-bit moments, bf16 weights with 16-bit remainders), INT4
// or INT4_REMAINDER; FIELD is the AdamLowBitTuning field in capitals
// (BLOCK_THREADS, MIN_BLOCKS, CHUNK_PARTS, PREFETCH_AHEAD, QUADS, STAGE,
// STAGE_QUADS, STAGE_ABSMAX, PREFETCH_ABSMAX). The bool fields take true,
// false, 1 or 0. E.g. -DGRADKIT_ADAM_INT8_MIN_BLOCKS=4 or
// -DGRADKIT_ADAM_INT4_STAGE=true on the object's command line (what
// dev/gpu/kernel_variant.py does), or in CMAKE_CUDA_FLAGS for a whole build.
// Each value's comment says what it sets and why.
#pragma once

namespace gradkit::cuda {

// What an entry sets, per field (the op's constant in parentheses).
struct AdamLowBitTuning {
  int block_threads;     // threads a block (kBlockThreads; cuda/multi_tensor.cuh)
  int min_blocks;        // blocks kept per multiprocessor (kMinBlocks): with block_threads, the register budget
  int chunk_parts;       // thread blocks per chunk, each on whole spans (kChunkParts)
  int prefetch_ahead;    // how many of its spans ahead a warp asks L2 for (kPrefetchAhead; prefetch_l2), 0: none
  bool quads;            // whole spans read and written in quads (cuda::LaneSpan), in a loop of their own (kQuads)
  bool stage;            // a chunk's whole spans through shared memory, a round ahead (kStage; cuda/span_stage.cuh;
                         // sm_90 and later only)
  bool stage_quads;      // staged spans read from the slot, and so written, in quads (kStageQuads)
  bool stage_absmax;     // a staged span's two absmax copied with the round into the slot (kStageAbsmax)
  bool prefetch_absmax;  // staged without stage_absmax: the round's absmax asked of L2 with the round
                         // (kPrefetchAbsmax)
};

// kAdamInt8 (GRADKIT_ADAM_INT8_*): 8-bit moments, f32 weights.
#ifndef GRADKIT_ADAM_INT8_BLOCK_THREADS
#define GRADKIT_ADAM_INT8_BLOCK_THREADS 256  // threads a block: 256 x 3 (80 registers) is the fastest over the GPT-2
                                             // list (measured: bench/log/2026-11-26.md, "block sizes and register
                                             // budgets"); 16 warps a block do not build staged (the slot and tables
                                             // pass the 48 KB of static shared memory)
#endif
#ifndef GRADKIT_ADAM_INT8_MIN_BLOCKS
#define GRADKIT_ADAM_INT8_MIN_BLOCKS 3  // blocks a multiprocessor: 256 x 3, 80 registers (measured:
                                        // bench/log/2026-11-26.md, "block sizes and register budgets")
#endif
#ifndef GRADKIT_ADAM_INT8_CHUNK_PARTS
#define GRADKIT_ADAM_INT8_CHUNK_PARTS 2  // blocks a chunk: two shorten the launch's tail (measured:
                                         // bench/log/2026-11-27.md, "the low-bit kernels on their words";
                                         // bench/log/2026-11-28.md, "two blocks a chunk for the 8-bit forms"); three
                                         // would start the second part's absmax 8 bytes off the copy engine's 16, so
                                         // that none of its spans would be staged
#endif
#ifndef GRADKIT_ADAM_INT8_PREFETCH_AHEAD
#define GRADKIT_ADAM_INT8_PREFETCH_AHEAD 0  // no L2 asks: only the 4-bit remainder form gains (measured:
                                            // bench/log/2026-11-27.md, "the low-bit kernels on their words")
#endif
#ifndef GRADKIT_ADAM_INT8_QUADS
#define GRADKIT_ADAM_INT8_QUADS false  // one loop: quads are slower for the 8-bit forms (measured:
                                       // bench/log/2026-11-27.md, "the 4-bit forms' accesses in quads")
#endif
#ifndef GRADKIT_ADAM_INT8_STAGE
#define GRADKIT_ADAM_INT8_STAGE true  // staged: pays for the 8-bit forms, one copy a list a round keeping the copies'
                                      // operand moves off the element path (measured: bench/log/2026-11-27.md, "the
                                      // 8-bit forms' spans through shared memory")
#endif
#ifndef GRADKIT_ADAM_INT8_STAGE_QUADS
#define GRADKIT_ADAM_INT8_STAGE_QUADS true  // the slot read in quads: no bank conflicts, where 8 consecutive f32 a lane
                                            // are two-way (measured: bench/log/2026-11-27.md, "the 8-bit forms' spans
                                            // through shared memory")
#endif
#ifndef GRADKIT_ADAM_INT8_STAGE_ABSMAX
#define GRADKIT_ADAM_INT8_STAGE_ABSMAX true  // the absmax through the slot: loaded from the lists, they are where the
                                             // warps wait most (measured: bench/log/2026-11-27.md, "the absmax through
                                             // the slot")
#endif
#ifndef GRADKIT_ADAM_INT8_PREFETCH_ABSMAX
#define GRADKIT_ADAM_INT8_PREFETCH_ABSMAX true  // read only without STAGE_ABSMAX: the round's absmax asked of L2 as the
                                                // round is asked for; loaded from the lists without either, they are
                                                // where the warps wait most (measured: bench/log/2026-11-27.md, "the
                                                // absmax through the slot")
#endif
inline constexpr AdamLowBitTuning kAdamInt8 = {
    .block_threads = GRADKIT_ADAM_INT8_BLOCK_THREADS,
    .min_blocks = GRADKIT_ADAM_INT8_MIN_BLOCKS,
    .chunk_parts = GRADKIT_ADAM_INT8_CHUNK_PARTS,
    .prefetch_ahead = GRADKIT_ADAM_INT8_PREFETCH_AHEAD,
    .quads = GRADKIT_ADAM_INT8_QUADS,
    .stage = GRADKIT_ADAM_INT8_STAGE,
    .stage_quads = GRADKIT_ADAM_INT8_STAGE_QUADS,
    .stage_absmax = GRADKIT_ADAM_INT8_STAGE_ABSMAX,
    .prefetch_absmax = GRADKIT_ADAM_INT8_PREFETCH_ABSMAX,
};

// kAdamInt8Remainder (GRADKIT_ADAM_INT8_REMAINDER_*): 8-bit moments, bf16 weights with 16-bit remainders.
#ifndef GRADKIT_ADAM_INT8_REMAINDER_BLOCK_THREADS
#define GRADKIT_ADAM_INT8_REMAINDER_BLOCK_THREADS 256  // threads a block: 256 x 4 (64 registers, fewer bytes in flight
                                                       // a round) is the fastest for this form (measured:
                                                       // bench/log/2026-11-28.md, "the remainder form at four blocks");
                                                       // 16 warps a block do not build staged (the slot and tables pass
                                                       // the 48 KB of static shared memory)
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_MIN_BLOCKS
#define GRADKIT_ADAM_INT8_REMAINDER_MIN_BLOCKS 4  // blocks a multiprocessor: 256 x 4, 64 registers (measured:
                                                  // bench/log/2026-11-28.md, "the remainder form at four blocks")
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_CHUNK_PARTS
#define GRADKIT_ADAM_INT8_REMAINDER_CHUNK_PARTS 2  // as INT8's (measured: bench/log/2026-11-27.md, "the low-bit kernels
                                                   // on their words"; bench/log/2026-11-28.md, "two blocks a chunk for
                                                   // the 8-bit forms")
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_PREFETCH_AHEAD
#define GRADKIT_ADAM_INT8_REMAINDER_PREFETCH_AHEAD 0  // as INT8's (measured: bench/log/2026-11-27.md, "the low-bit
                                                      // kernels on their words")
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_QUADS
#define GRADKIT_ADAM_INT8_REMAINDER_QUADS false  // as INT8's (measured: bench/log/2026-11-27.md, "the 4-bit forms'
                                                 // accesses in quads")
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_STAGE
#define GRADKIT_ADAM_INT8_REMAINDER_STAGE true  // as INT8's (measured: bench/log/2026-11-27.md, "the 8-bit forms' spans
                                                // through shared memory")
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_STAGE_QUADS
#define GRADKIT_ADAM_INT8_REMAINDER_STAGE_QUADS true  // as INT8's (measured: bench/log/2026-11-27.md, "the 8-bit forms'
                                                      // spans through shared memory")
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_STAGE_ABSMAX
#define GRADKIT_ADAM_INT8_REMAINDER_STAGE_ABSMAX true  // as INT8's: both 8-bit forms stage them (measured:
                                                       // bench/log/2026-11-27.md, "the absmax through the slot")
#endif
#ifndef GRADKIT_ADAM_INT8_REMAINDER_PREFETCH_ABSMAX
#define GRADKIT_ADAM_INT8_REMAINDER_PREFETCH_ABSMAX true  // as INT8's (measured: bench/log/2026-11-27.md, "the absmax
                                                          // through the slot")
#endif
inline constexpr AdamLowBitTuning kAdamInt8Remainder = {
    .block_threads = GRADKIT_ADAM_INT8_REMAINDER_BLOCK_THREADS,
    .min_blocks = GRADKIT_ADAM_INT8_REMAINDER_MIN_BLOCKS,
    .chunk_parts = GRADKIT_ADAM_INT8_REMAINDER_CHUNK_PARTS,
    .prefetch_ahead = GRADKIT_ADAM_INT8_REMAINDER_PREFETCH_AHEAD,
    .quads = GRADKIT_ADAM_INT8_REMAINDER_QUADS,
    .stage = GRADKIT_ADAM_INT8_REMAINDER_STAGE,
    .stage_quads = GRADKIT_ADAM_INT8_REMAINDER_STAGE_QUADS,
    .stage_absmax = GRADKIT_ADAM_INT8_REMAINDER_STAGE_ABSMAX,
    .prefetch_absmax = GRADKIT_ADAM_INT8_REMAINDER_PREFETCH_ABSMAX,
};

// kAdamInt4 (GRADKIT_ADAM_INT4_*): 4-bit moments, f32 weights.
#ifndef GRADKIT_ADAM_INT4_BLOCK_THREADS
#define GRADKIT_ADAM_INT4_BLOCK_THREADS 512  // threads a block: 512 x 2 (64 registers) is the fastest over the GPT-2
                                             // list (measured: bench/log/2026-11-26.md, "block sizes and register
                                             // budgets")
#endif
#ifndef GRADKIT_ADAM_INT4_MIN_BLOCKS
#define GRADKIT_ADAM_INT4_MIN_BLOCKS 2  // blocks a multiprocessor: 512 x 2, 64 registers (measured:
                                        // bench/log/2026-11-26.md, "block sizes and register budgets")
#endif
#ifndef GRADKIT_ADAM_INT4_CHUNK_PARTS
#define GRADKIT_ADAM_INT4_CHUNK_PARTS 4  // blocks a chunk: four shorten the launch's tail (measured:
                                         // bench/log/2026-11-27.md, "the low-bit kernels on their words")
#endif
#ifndef GRADKIT_ADAM_INT4_PREFETCH_AHEAD
#define GRADKIT_ADAM_INT4_PREFETCH_AHEAD 0  // no L2 asks: only the 4-bit remainder form gains (measured:
                                            // bench/log/2026-11-27.md, "the low-bit kernels on their words")
#endif
#ifndef GRADKIT_ADAM_INT4_QUADS
#define GRADKIT_ADAM_INT4_QUADS true  // whole spans in quads, in a loop of their own: faster for the 4-bit forms
                                      // (measured: bench/log/2026-11-27.md, "the 4-bit forms' accesses in quads")
#endif
#ifndef GRADKIT_ADAM_INT4_STAGE
#define GRADKIT_ADAM_INT4_STAGE false  // not staged: staging costs the 4-bit forms (measured: bench/log/2026-11-27.md,
                                       // "the 8-bit forms' spans through shared memory")
#endif
#ifndef GRADKIT_ADAM_INT4_STAGE_QUADS
#define GRADKIT_ADAM_INT4_STAGE_QUADS true  // read only with STAGE: the staged 8-bit forms' choice
#endif
#ifndef GRADKIT_ADAM_INT4_STAGE_ABSMAX
#define GRADKIT_ADAM_INT4_STAGE_ABSMAX true  // read only with STAGE: the staged 8-bit forms' choice
#endif
#ifndef GRADKIT_ADAM_INT4_PREFETCH_ABSMAX
#define GRADKIT_ADAM_INT4_PREFETCH_ABSMAX true  // read only with STAGE: the staged 8-bit forms' choice
#endif
inline constexpr AdamLowBitTuning kAdamInt4 = {
    .block_threads = GRADKIT_ADAM_INT4_BLOCK_THREADS,
    .min_blocks = GRADKIT_ADAM_INT4_MIN_BLOCKS,
    .chunk_parts = GRADKIT_ADAM_INT4_CHUNK_PARTS,
    .prefetch_ahead = GRADKIT_ADAM_INT4_PREFETCH_AHEAD,
    .quads = GRADKIT_ADAM_INT4_QUADS,
    .stage = GRADKIT_ADAM_INT4_STAGE,
    .stage_quads = GRADKIT_ADAM_INT4_STAGE_QUADS,
    .stage_absmax = GRADKIT_ADAM_INT4_STAGE_ABSMAX,
    .prefetch_absmax = GRADKIT_ADAM_INT4_PREFETCH_ABSMAX,
};

// kAdamInt4Remainder (GRADKIT_ADAM_INT4_REMAINDER_*): 4-bit moments, bf16 weights with 16-bit remainders.
#ifndef GRADKIT_ADAM_INT4_REMAINDER_BLOCK_THREADS
#define GRADKIT_ADAM_INT4_REMAINDER_BLOCK_THREADS 512  // as INT4's (measured: bench/log/2026-11-26.md, "block sizes and
                                                       // register budgets")
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_MIN_BLOCKS
#define GRADKIT_ADAM_INT4_REMAINDER_MIN_BLOCKS 2  // as INT4's (measured: bench/log/2026-11-26.md, "block sizes and
                                                  // register budgets")
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_CHUNK_PARTS
#define GRADKIT_ADAM_INT4_REMAINDER_CHUNK_PARTS 4  // as INT4's (measured: bench/log/2026-11-27.md, "the low-bit kernels
                                                   // on their words")
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_PREFETCH_AHEAD
#define GRADKIT_ADAM_INT4_REMAINDER_PREFETCH_AHEAD 1  // L2 asked for the warp's next span: this form gains, the only
                                                      // one (measured: bench/log/2026-11-27.md, "the low-bit kernels on
                                                      // their words")
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_QUADS
#define GRADKIT_ADAM_INT4_REMAINDER_QUADS true  // as INT4's (measured: bench/log/2026-11-27.md, "the 4-bit forms'
                                                // accesses in quads")
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_STAGE
#define GRADKIT_ADAM_INT4_REMAINDER_STAGE false  // as INT4's (measured: bench/log/2026-11-27.md, "the 8-bit forms'
                                                 // spans through shared memory")
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_STAGE_QUADS
#define GRADKIT_ADAM_INT4_REMAINDER_STAGE_QUADS true  // read only with STAGE: the staged 8-bit forms' choice
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_STAGE_ABSMAX
#define GRADKIT_ADAM_INT4_REMAINDER_STAGE_ABSMAX true  // read only with STAGE: the staged 8-bit forms' choice
#endif
#ifndef GRADKIT_ADAM_INT4_REMAINDER_PREFETCH_ABSMAX
#define GRADKIT_ADAM_INT4_REMAINDER_PREFETCH_ABSMAX true  // read only with STAGE: the staged 8-bit forms' choice
#endif
inline constexpr AdamLowBitTuning kAdamInt4Remainder = {
    .block_threads = GRADKIT_ADAM_INT4_REMAINDER_BLOCK_THREADS,
    .min_blocks = GRADKIT_ADAM_INT4_REMAINDER_MIN_BLOCKS,
    .chunk_parts = GRADKIT_ADAM_INT4_REMAINDER_CHUNK_PARTS,
    .prefetch_ahead = GRADKIT_ADAM_INT4_REMAINDER_PREFETCH_AHEAD,
    .quads = GRADKIT_ADAM_INT4_REMAINDER_QUADS,
    .stage = GRADKIT_ADAM_INT4_REMAINDER_STAGE,
    .stage_quads = GRADKIT_ADAM_INT4_REMAINDER_STAGE_QUADS,
    .stage_absmax = GRADKIT_ADAM_INT4_REMAINDER_STAGE_ABSMAX,
    .prefetch_absmax = GRADKIT_ADAM_INT4_REMAINDER_PREFETCH_ABSMAX,
};

// The entry of a form: 8- or 4-bit moments, with remainders or not.
constexpr AdamLowBitTuning adam_low_bit_tuning(bool eight_bit, bool remainder) {
  if (eight_bit) return remainder ? kAdamInt8Remainder : kAdamInt8;
  return remainder ? kAdamInt4Remainder : kAdamInt4;
}

}  // namespace gradkit::cuda
