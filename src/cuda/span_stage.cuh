// A thread block's next round of spans (one a warp), copied into shared
// memory by the copy engine (cp.async.bulk, sm_90) while its warps compute
// this round: what the low-bit kernels (cuda/adam_low_bit.cu) need to have
// their loads in flight without registers to hold them. Their register
// budgets (64 or 80 a thread) leave none for a span loaded ahead (two spans'
// registers cost more occupancy than they give), and staging by each lane
// (cp.async) costs 9 to 11 instructions an element in addresses (measured:
// bench/log/2026-11-27.md, "the low-bit kernels on the H200" and "where the
// int8 kernel waits"). Here one lane asks for each list's round in one
// copy, and a warp's part of a round costs it a wait on one mbarrier and
// one shared atomic (a copy per warp and list costs 11 instructions an
// element: the compiler moves each copy's operands into uniform registers).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/multi_tensor.cuh"

namespace gradkit::cuda {

// The copy engine and mbarrier transaction counts are sm_90's: a build for
// an older architecture as well (CMAKE_CUDA_ARCHITECTURES) reads every span
// from the lists there (a kernel stages only `if constexpr (kCanStage)`, so
// RoundStage's instructions are never emitted for it).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
inline constexpr bool kCanStage = false;
#else
inline constexpr bool kCanStage = true;
#endif

// The copy engine's granularity: every source and destination address and
// every size is a multiple of it.
inline constexpr int kStageAlign = 16;

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Whether p may be the source of a staged copy. A list whose vector
// accesses are a multiple of kStageAlign bytes needs no test beyond
// vector_aligned's.
__device__ __forceinline__ bool stage_aligned(const void* p) {
  return vector_aligned<kStageAlign>(static_cast<const uint8_t*>(p));
}

// What a block's round needs in shared memory besides its slot: the mbarrier
// its copies complete on, and the count of warps' reads (the warp that reads
// a round last asks for the next one into the same slot).
struct RoundSignals {
  uint64_t filled;
  uint32_t reads;
};

// The block's slot, reused round after round: every warp reads its part
// into registers and counts its read (after __syncwarp, so that its lanes'
// reads come first); the last to read asks for the next round.
class RoundStage {
 public:
  __device__ RoundStage(uint8_t* slot, RoundSignals* signals)
      : slot_(slot), signals_(signals), filled_(shared_address(&signals->filled)) {}

  // By one thread, before the block's barrier that precedes any use.
  __device__ __forceinline__ void init() const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(filled_) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    signals_->reads = 0;
  }

  __device__ __forceinline__ const uint8_t* slot() const { return slot_; }

  // By the asking lane alone: expect() the round's total bytes, then copy()
  // each list's part, `bytes` from src into the slot at `offset`.
  __device__ __forceinline__ void expect(uint32_t bytes) const {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(filled_), "r"(bytes) : "memory");
  }
  __device__ __forceinline__ void copy(int offset, const void* src, uint32_t bytes) const {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            shared_address(slot_ + offset)),
        "l"(src), "r"(bytes), "r"(filled_)
        : "memory");
  }

  // Every lane waits for the round's copies; the next wait is for the next
  // round.
  __device__ __forceinline__ void wait() {
    uint32_t done = 0;
    do {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(filled_), "r"(parity_)
          : "memory");
    } while (!done);
    parity_ ^= 1u;
  }

  // By lane 0 of each warp, after the warp's reads of a full round of
  // `warps` parts and a __syncwarp: whether this warp read it last, in which
  // case the reads of every warp come before the copy engine's next writes
  // into the slot (the count's acquire and release order the warps' reads;
  // the proxy fence, those reads before the copies). compute-sanitizer's
  // racecheck does not take this count as an order: it reports each read
  // against the next round's copies, as it does a real early ask, and
  // nothing when __syncthreads orders the same accesses (measured:
  // bench/log/2026-11-29.md, "the staged kernels' round protocol");
  // tests/test_span_stage.cu is the check.
  __device__ __forceinline__ bool read_last(int warps) const {
    uint32_t before;
    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;"
                 : "=r"(before)
                 : "r"(shared_address(&signals_->reads))
                 : "memory");
    const bool last = before % static_cast<uint32_t>(warps) == static_cast<uint32_t>(warps) - 1;
    if (last) reads_before_copies();
    return last;
  }

  // By the asking lane, once the block's reads of the slot are ordered before
  // it (read_last's count, or a block barrier): the proxy fence that keeps
  // those generic reads before the copy engine's next writes.
  __device__ __forceinline__ static void reads_before_copies() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }

 private:
  uint8_t* slot_;
  RoundSignals* signals_;
  uint32_t filled_;
  uint32_t parity_ = 0;
};

}  // namespace gradkit::cuda
