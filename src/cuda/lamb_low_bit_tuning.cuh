// The tuning table of LAMB's low-bit passes (cuda/lamb_low_bit.cu): one
// entry per pass, for both forms (8- and 4-bit moments), from which
// NormsLowBitOp and UpdateLowBitOp take their launch constants and L2
// prefetch. The low-bit Adam kernel has a table of its own
// (cuda/adam_low_bit_tuning.cuh): its knobs are not LAMB's, and each
// kernel's source includes its own table alone, so that a change to one
// table rebuilds one object.
//
// Every value is a macro that a compile definition overrides, named
// GRADKIT_LAMB_LOW_BIT_<PASS>_<FIELD>: PASS is NORMS (pass 1) or UPDATE
// (pass 2); FIELD is the entry's field in capitals (BLOCK_THREADS,
// MIN_BLOCKS, and for NORMS PREFETCH_AHEAD). E.g.
// -DGRADKIT_LAMB_LOW_BIT_NORMS_MIN_BLOCKS=5 on the object's command line
// (what dev/gpu/kernel_variant.py does), or in CMAKE_CUDA_FLAGS for a whole
// build. Each value's comment says what it sets and why.
#pragma once

namespace gradkit::cuda {

// What an entry sets, per field (the op's constant in parentheses).
struct LambLowBitNormsTuning {
  int block_threads;   // threads a block (kBlockThreads; cuda/multi_tensor.cuh)
  int min_blocks;      // blocks kept per multiprocessor (kMinBlocks): with block_threads, the register budget
  int prefetch_ahead;  // how many of its spans ahead a warp asks L2 for (kPrefetchAhead; prefetch_l2), 0: none
};
struct LambLowBitUpdateTuning {
  int block_threads;  // as LambLowBitNormsTuning's
  int min_blocks;     // as LambLowBitNormsTuning's
};

// kLambLowBitNorms (GRADKIT_LAMB_LOW_BIT_NORMS_*): pass 1, NormsLowBitOp: the moments' update and the per-tensor sums.
#ifndef GRADKIT_LAMB_LOW_BIT_NORMS_BLOCK_THREADS
#define GRADKIT_LAMB_LOW_BIT_NORMS_BLOCK_THREADS 256  // threads a block: 256 x 4 is the fastest for pass 1; the block
                                                      // sums' order does not depend on the block's size (measured:
                                                      // bench/log/2026-11-26.md, "block sizes and register budgets";
                                                      // bench/log/2026-11-28.md, "LAMB's low-bit passes at four and
                                                      // five blocks")
#endif
#ifndef GRADKIT_LAMB_LOW_BIT_NORMS_MIN_BLOCKS
#define GRADKIT_LAMB_LOW_BIT_NORMS_MIN_BLOCKS 4  // blocks a multiprocessor: 256 x 4, at most 64 registers (measured:
                                                 // bench/log/2026-11-26.md, "block sizes and register budgets";
                                                 // bench/log/2026-11-28.md, "LAMB's low-bit passes at four and five
                                                 // blocks")
#endif
#ifndef GRADKIT_LAMB_LOW_BIT_NORMS_PREFETCH_AHEAD
#define GRADKIT_LAMB_LOW_BIT_NORMS_PREFETCH_AHEAD 1  // L2 asked for the warp's next span, which pays here (measured:
                                                     // bench/log/2026-11-26.md, "the low-bit kernels nearer their
                                                     // floors")
#endif
inline constexpr LambLowBitNormsTuning kLambLowBitNorms = {
    .block_threads = GRADKIT_LAMB_LOW_BIT_NORMS_BLOCK_THREADS,
    .min_blocks = GRADKIT_LAMB_LOW_BIT_NORMS_MIN_BLOCKS,
    .prefetch_ahead = GRADKIT_LAMB_LOW_BIT_NORMS_PREFETCH_AHEAD,
};

// kLambLowBitUpdate (GRADKIT_LAMB_LOW_BIT_UPDATE_*): pass 2, UpdateLowBitOp: the weights' update.
#ifndef GRADKIT_LAMB_LOW_BIT_UPDATE_BLOCK_THREADS
#define GRADKIT_LAMB_LOW_BIT_UPDATE_BLOCK_THREADS 256  // threads a block: 256 x 5 is the fastest for pass 2 (measured:
                                                       // bench/log/2026-11-28.md, "LAMB's low-bit passes at four and
                                                       // five blocks")
#endif
#ifndef GRADKIT_LAMB_LOW_BIT_UPDATE_MIN_BLOCKS
#define GRADKIT_LAMB_LOW_BIT_UPDATE_MIN_BLOCKS 5  // blocks a multiprocessor: 256 x 5, 48 registers, none spilled; six
                                                  // (40 registers) spill and are slower (measured:
                                                  // bench/log/2026-11-28.md, "LAMB's low-bit passes at four and five
                                                  // blocks")
#endif
inline constexpr LambLowBitUpdateTuning kLambLowBitUpdate = {
    .block_threads = GRADKIT_LAMB_LOW_BIT_UPDATE_BLOCK_THREADS,
    .min_blocks = GRADKIT_LAMB_LOW_BIT_UPDATE_MIN_BLOCKS,
};

}  // namespace gradkit::cuda
