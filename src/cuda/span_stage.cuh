// A thread block's next round of spans (one a warp), copied into shared
// memory by the copy engine (cp.async.bulk, sm_90) while its warps compute
// this round: what the low-bit kernels (cuda/adam_low_bit.cu) need to have
// their loads in flight without registers to hold them. Their register
// budgets (64 or 80 a thread) leave none for a span loaded ahead (two spans'
// registers cost occupancy more than they gave, bench/RESULTS.md,
// 2026-11-27, fifth session), and staging by each lane (cp.async) cost 9 to
// 11 instructions an element in addresses (fourth session). Here one lane
// asks for each list's round in one copy, and a warp's part of a round
// costs it a wait on one mbarrier and one shared atomic (a copy per warp
// and list cost 11 instructions an element: the compiler moves each copy's
// operands into uniform registers).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/multi_tensor.cuh"

namespace gradkit::cuda {

// The copy engine and mbarrier transaction counts are sm_90's: code
// compiled for an older virtual architecture `arch` (as __CUDA_ARCH__ / 10;
// CMAKE_CUDA_ARCHITECTURES may add one) reads every span from the lists (a
// kernel stages only `if constexpr (kCanStage)`, so RoundStage's
// instructions are never emitted for it), and its launch asks for no slots
// (the host asks can_stage of the architecture the device runs).
constexpr bool can_stage(int arch) { return arch >= 90; }
#if defined(__CUDA_ARCH__)
inline constexpr bool kCanStage = can_stage(__CUDA_ARCH__ / 10);
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

// What a slot needs in shared memory besides its bytes: the mbarrier its
// round's copies complete on, and the count of warps' reads (the warp that
// reads a round last asks for a later one into the same slot).
struct RoundSignals {
  uint64_t filled;
  uint32_t reads;
};

// The block's kSlots slots, used in turn round after round (round r in slot
// r % kSlots), each slot's round asked for kSlots rounds ahead: every warp
// reads its part of round r into registers and counts its read (after
// __syncwarp, so that its lanes' reads come first); the last to read asks
// for round r + kSlots into the same slot. With one slot, a round is asked
// for only once every warp has read the one before, so the warps wait for
// a whole copy whenever a round's computing is shorter than it; a second
// slot keeps a round more in flight. Every call names its round, from which
// the slot and the mbarrier's phase follow: the class holds no state a
// thread would keep in registers beyond the two shared addresses.
template <int kSlots, int kSlotBytes>
class RoundStage {
 public:
  static_assert(kSlots >= 1 && kSlotBytes % kStageAlign == 0);
  // `slots`: kSlots slots of kSlotBytes each, one after the other;
  // `signals`: kSlots of them.
  __device__ RoundStage(uint8_t* slots, RoundSignals* signals) : slots_(slots), signals_(signals) {}

  // By one thread, before the block's barrier that precedes any use.
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < kSlots; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&signals_[s].filled)) : "memory");
      signals_[s].reads = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }

  __device__ __forceinline__ const uint8_t* slot(int round) const { return slots_ + index(round) * kSlotBytes; }

  // By the asking lane alone: expect() the round's total bytes, then copy()
  // each list's part, `bytes` from src into the round's slot at `offset`.
  __device__ __forceinline__ void expect(int round, uint32_t bytes) const {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(filled(round)), "r"(bytes) : "memory");
  }
  __device__ __forceinline__ void copy(int round, int offset, const void* src, uint32_t bytes) const {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            shared_address(slot(round) + offset)),
        "l"(src), "r"(bytes), "r"(filled(round))
        : "memory");
  }

  // Every lane waits for the round's copies: the (round / kSlots)-th phase
  // of its slot's mbarrier.
  __device__ __forceinline__ void wait(int round) const {
    const uint32_t parity = static_cast<uint32_t>(round) / kSlots % 2;
    uint32_t done = 0;
    do {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(filled(round)), "r"(parity)
          : "memory");
    } while (!done);
  }

  // By lane 0 of each warp, after the warp's reads of a full round of
  // `warps` parts and a __syncwarp: whether this warp read it last, in which
  // case the reads of every warp come before the copy engine's next writes
  // into the slot (the count's acquire and release order the warps' reads;
  // the proxy fence, those reads before the copies).
  __device__ __forceinline__ bool read_last(int round, int warps) const {
    uint32_t before;
    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;"
                 : "=r"(before)
                 : "r"(shared_address(&signals_[index(round)].reads))
                 : "memory");
    const bool last = before % static_cast<uint32_t>(warps) == static_cast<uint32_t>(warps) - 1;
    if (last) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    return last;
  }

 private:
  // The round's slot (a round is never negative: unsigned, the division
  // needs no sign's correction).
  static __device__ __forceinline__ uint32_t index(int round) { return static_cast<uint32_t>(round) % kSlots; }
  __device__ __forceinline__ uint32_t filled(int round) const { return shared_address(&signals_[index(round)].filled); }

  uint8_t* slots_;
  RoundSignals* signals_;
};

}  // namespace gradkit::cuda
