// cuda/span_stage.cuh's RoundStage under the protocol the staged low-bit
// kernels run (cuda/adam_low_bit.cu's update_staged): thread 0 asks for a
// block's first round; every warp waits for the round, reads its part,
// __syncwarp, and counts its read; the warp that reads a round last asks for
// the next round into the same slot. Here each block streams rounds of
// seeded random bytes through its slot while warps are held back at random
// (a __nanosleep between the round's arrival and their read, the window in
// which an early ask would overwrite what they have yet to read), and every
// lane writes out what it read: the output must equal the input byte for
// byte. The negative control asks for round 1 once every warp is past its
// wait for round 0 but before warp 7 has read it (warp 7 reads once round 1
// has landed): the test requires that every block is caught. The third
// protocol orders the rounds by __syncthreads instead of the count; it is
// here for compute-sanitizer's racecheck (scripts/gpu sanitizers staging), which
// models __syncthreads: what racecheck still reports on it would be on the
// copy engine's writes and the mbarrier alone, not on the count. Skips
// without a GPU of compute capability 9.0 or later, or where the kernel was
// built for an older one (no copy engine).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/low_bit_lanes.cuh"
#include "cuda/span_stage.cuh"
#include "support/check_cuda.h"
#include "support/test_tensor.h"

namespace {

using gradkit::cuda::kLanes;
using gradkit::cuda::RoundSignals;
using gradkit::cuda::RoundStage;
using gradkit::test::cuda_available;

enum class Protocol { last_reader_asks, warp0_asks_round1_early, block_barrier };

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kLanes;
constexpr int kRoundVectors = kThreads;  // a uint4 a lane
constexpr int kRoundBytes = kRoundVectors * static_cast<int>(sizeof(uint4));
constexpr int kSlowWarp = kWarps - 1;  // the negative control's

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// `staged` is set when the kernel was built with the copy engine
// (cuda::kCanStage), so that the host can skip rather than compare nothing.
template <Protocol kProtocol>
__global__ void __launch_bounds__(kThreads) stream_rounds(const uint4* input, uint4* output, int rounds, uint32_t seed,
                                                          unsigned max_sleep_ns, int* staged) {
  if constexpr (gradkit::cuda::kCanStage) {
    struct alignas(128) Memory {
      uint8_t slot[kRoundBytes];
      RoundSignals signals;
      // The negative control's: how many warps are past their wait for
      // round 0, and whether round 1 has landed in the slot.
      int waited;
      int landed;
    };
    __shared__ Memory memory;
    constexpr bool kControl = kProtocol == Protocol::warp0_asks_round1_early;
    const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
    const size_t block_at = static_cast<size_t>(blockIdx.x) * rounds * kRoundVectors;
    RoundStage stage(memory.slot, &memory.signals);
    const auto ask = [&](int round) {
      stage.expect(kRoundBytes);
      stage.copy(0, input + block_at + static_cast<size_t>(round) * kRoundVectors, kRoundBytes);
    };
    if (threadIdx.x == 0) {
      if (blockIdx.x == 0) *staged = 1;
      memory.waited = 0;
      memory.landed = 0;
      stage.init();
      ask(0);
    }
    __syncthreads();
    for (int r = 0; r < rounds; ++r) {
      stage.wait();
      const bool more = r + 1 < rounds;
      const bool control_round = kControl && r == 0 && more;
      if (control_round) {
        // Every warp counts its wait (so that no warp can miss round 0's
        // phase: its lanes first, then the warp); warp kSlowWarp reads only
        // once round 1 has landed.
        __syncwarp();
        if (lane == 0) atomicAdd(&memory.waited, 1);
        if (warp == kSlowWarp) {
          if (lane == 0) {
            while (atomicOr(&memory.landed, 0) == 0) {
            }
            __threadfence_block();
          }
          __syncwarp();
        }
      } else {
        // A quarter of the warps, different each round and block, sleep up
        // to max_sleep_ns before their read.
        const uint32_t h = mix(seed ^ mix((blockIdx.x << 16) ^ (static_cast<uint32_t>(r) << 4) ^ warp));
        const unsigned sleep_ns = (h & 3u) == 0 ? (h >> 8) % (max_sleep_ns + 1) : 0;
        if (sleep_ns > 0) __nanosleep(sleep_ns);
      }
      asm volatile("" ::: "memory");  // the read stays after the sleep or the wait
      // Stored only after the count and the ask, as the kernels use what
      // they read only after theirs: the read may still be in flight there.
      const uint4 v = reinterpret_cast<const uint4*>(stage.slot())[threadIdx.x];
      if constexpr (kProtocol == Protocol::block_barrier) {
        __syncthreads();
        if (threadIdx.x == 0 && more) {
          RoundStage::reads_before_copies();
          ask(r + 1);
        }
      } else {
        __syncwarp();
        if (lane == 0) {
          const bool last = stage.read_last(kWarps);
          if (control_round) {
            // The early ask: once every warp is past its wait, whether or
            // not it has read; then round 1's landing is told to warp
            // kSlowWarp.
            if (warp == 0) {
              while (atomicOr(&memory.waited, 0) < kWarps) {
              }
              ask(1);
              // Round 1's wait on a copy of the stage, which leaves warp
              // 0's own count of phases where it is.
              RoundStage(stage).wait();
              __threadfence_block();
              atomicExch(&memory.landed, 1);
            }
          } else if (last && more) {
            ask(r + 1);
          }
        }
      }
      output[block_at + static_cast<size_t>(r) * kRoundVectors + threadIdx.x] = v;
      // Round 1 landed before warp kSlowWarp counted round 0: without a
      // barrier here the other warps' counts of round 1 would come first,
      // and the count would name a last reader a round early from then on
      // (asks in a phase that has had its arrival: the launch fails).
      if (control_round) __syncthreads();
    }
  }
}

struct Streamed {
  bool staged = false;
  size_t parts = 0;         // warp parts of rounds, in all blocks
  size_t wrong_parts = 0;   // of them, those whose bytes differ from the input's
  size_t wrong_later = 0;   // of those, in a round after round 0
  size_t wrong_blocks = 0;  // blocks with a wrong part
};

template <Protocol kProtocol>
void stream(int blocks, int rounds, unsigned max_sleep_ns, Streamed& got) {
  const size_t vectors = static_cast<size_t>(blocks) * rounds * kRoundVectors;
  std::vector<uint32_t> input(vectors * 4);
  std::mt19937 random(20261129u);
  for (auto& word : input) word = random();
  uint4 *input_device = nullptr, *output_device = nullptr;
  int* staged_device = nullptr;
  CHECK_CUDA(cudaMalloc(&input_device, vectors * sizeof(uint4)));
  CHECK_CUDA(cudaMalloc(&output_device, vectors * sizeof(uint4)));
  CHECK_CUDA(cudaMalloc(&staged_device, sizeof(int)));
  CHECK_CUDA(cudaMemcpy(input_device, input.data(), vectors * sizeof(uint4), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(output_device, 0, vectors * sizeof(uint4)));
  CHECK_CUDA(cudaMemset(staged_device, 0, sizeof(int)));
  stream_rounds<kProtocol><<<blocks, kThreads>>>(input_device, output_device, rounds, random(), max_sleep_ns,
                                                 staged_device);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint32_t> output(vectors * 4);
  int staged = 0;
  CHECK_CUDA(cudaMemcpy(output.data(), output_device, vectors * sizeof(uint4), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(&staged, staged_device, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(input_device));
  CHECK_CUDA(cudaFree(output_device));
  CHECK_CUDA(cudaFree(staged_device));
  got = Streamed{staged != 0};
  const size_t part_words = kLanes * 4;
  for (int b = 0; b < blocks; ++b) {
    bool block_wrong = false;
    for (size_t p = 0; p < static_cast<size_t>(rounds) * kWarps; ++p) {
      const size_t at = (static_cast<size_t>(b) * rounds * kWarps + p) * part_words;
      const bool wrong = std::memcmp(&input[at], &output[at], part_words * sizeof(uint32_t)) != 0;
      got.wrong_parts += wrong;
      got.wrong_later += wrong && p >= static_cast<size_t>(kWarps);
      block_wrong |= wrong;
    }
    got.parts += static_cast<size_t>(rounds) * kWarps;
    got.wrong_blocks += block_wrong;
  }
}

// The blocks and rounds each test streams, on a GPU of compute capability
// 9.0 or later (else the test skips): 3 blocks a multiprocessor, 48 rounds;
// under compute-sanitizer, GRADKIT_STAGE_TEST_SMALL=1 streams 4 blocks of 8
// rounds (the tool runs the kernel thousands of times slower).
class RoundStageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int device = 0, major = 0, multiprocessors = 0;
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
    if (major < 9) GTEST_SKIP() << "no copy engine (cp.async.bulk) before compute capability 9.0";
    const char* small = std::getenv("GRADKIT_STAGE_TEST_SMALL");
    const bool is_small = small != nullptr && small[0] == '1';
    blocks = is_small ? 4 : 3 * multiprocessors;
    rounds = is_small ? 8 : 48;
  }
  int blocks = 0, rounds = 0;
};

#define SKIP_UNLESS_STAGED(got) \
  if (!(got).staged) GTEST_SKIP() << "the kernel was built without the copy engine (sm_90)"

TEST_F(RoundStageTest, EveryWarpReadsItsRoundWhenTheLastReaderAsks) {
  for (unsigned max_sleep_ns : {0u, 2000u, 10000u}) {
    Streamed got;
    ASSERT_NO_FATAL_FAILURE(stream<Protocol::last_reader_asks>(blocks, rounds, max_sleep_ns, got));
    SKIP_UNLESS_STAGED(got);
    EXPECT_EQ(got.wrong_parts, 0u) << "of " << got.parts << " warp parts, " << blocks << " blocks x " << rounds
                                   << " rounds, warps held back up to " << max_sleep_ns << " ns";
  }
}

TEST_F(RoundStageTest, EveryWarpReadsItsRoundWhenABlockBarrierOrdersTheRounds) {
  Streamed got;
  ASSERT_NO_FATAL_FAILURE(stream<Protocol::block_barrier>(blocks, rounds, 2000u, got));
  SKIP_UNLESS_STAGED(got);
  EXPECT_EQ(got.wrong_parts, 0u) << "of " << got.parts << " warp parts";
}

// The negative control: an ask before every warp has read the round is
// seen, in every block (warp 7 reads round 0's part once round 1 has
// landed in the slot).
TEST_F(RoundStageTest, AnAskBeforeEveryWarpHasReadIsCaught) {
  Streamed got;
  ASSERT_NO_FATAL_FAILURE(stream<Protocol::warp0_asks_round1_early>(blocks, rounds, 0u, got));
  SKIP_UNLESS_STAGED(got);
  EXPECT_EQ(got.wrong_blocks, static_cast<size_t>(blocks)) << "the early ask was seen in only " << got.wrong_blocks
                                                         << " of " << blocks << " blocks";
  // Only round 0's reads can be wrong (warp 7's, and any other warp's that
  // came after warp 0's ask): the rounds after it follow the protocol.
  EXPECT_EQ(got.wrong_later, 0u);
  std::printf("early ask: %zu of %d blocks read round 1's bytes for round 0\n", got.wrong_blocks, blocks);
}

}  // namespace
