// The CPU Adam loop over 8- or 4-bit blockwise moments: block by block, m
// and v decoded, every element updated by the shared formula
// (spec/adam_math.h, its folded form), then the block encoded again with
// its new absmax (the codecs: cpu/low_bit_codecs.h), as the CUDA kernel
// does; one loop per instruction set (isa.h), every per-launch choice a
// template parameter. Its four instances (8- or 4-bit codes, f32 weights or
// bf16 weights with remainders) are compiled in four files,
// adam_{8,4}bit_{plain,remainder}.cc, so that a build compiles them at
// once: in one file they take about ten minutes of one core, the longest
// compile of the build by far. adam_low_bit.cc picks the instance.
#pragma once

#include <algorithm>
#include <type_traits>

#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_tables.h"
#include "cpu/adam_kernel.h"
#include "cpu/low_bit_codecs.h"

namespace gradkit::spec::cpu_adam {

using cpu_low_bit::Codec4;
using cpu_low_bit::Codec8;

// One chunk (whole blocks: the plan's chunks are multiples of both block sizes).
template <class Codec, class Weights, class G, class Copy, class Mode, bool Scaled>
struct SpanLowBit {
  using W = typename Weights::Stored;
  static constexpr int kBlock = Codec::kBlock;
  static void run(int64_t n, W* __restrict w, int16_t* __restrict r, const G* __restrict g, uint8_t* __restrict qm,
                  uint8_t* __restrict qv, float* __restrict absmax_m, float* __restrict absmax_v,
                  Copy* __restrict copy, Codec codec, AdamCoefficients<float> c, float inverse_scale) {
    alignas(64) float m_old[kBlock], v_old[kBlock], m_new[kBlock], v_new[kBlock];
    for (int64_t b = 0; b * kBlock < n; ++b) {
      const int64_t base = b * kBlock;
      const int count = static_cast<int>(std::min<int64_t>(kBlock, n - base));
      codec.decode(0, qm, base, absmax_m[b], count, m_old);
      codec.decode(1, qv, base, absmax_v[b], count, v_old);
      for (int k = 0; k < count; ++k) {
        const int64_t i = base + k;
        float wc = Weights::load(w, r, i);
        float mc = m_old[k], vc = v_old[k], unused = 0;
        adam_element<float, Mode, AdamForm::folded>(wc, unscaled_by_reciprocal<Scaled>(g[i], inverse_scale), mc, vc,
                                                    unused, c, Mode{});
        Weights::store(w, r, i, wc);
        store_copy(copy, i, wc);
        m_new[k] = mc;
        v_new[k] = vc;
      }
      codec.encode(0, m_new, count, qm, base, absmax_m + b);
      codec.encode(1, v_new, count, qv, base, absmax_v + b);
    }
  }
};

template <class Codec, class Weights, class G, class Copy>
void run_chunks_low_bit(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa, Codec codec) {
  using W = typename Weights::Stored;
  constexpr int codes_per_byte = Codec::kCodesPerByte;
  const StepValues<float> values(launch.inputs);
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    const AdamCoefficients<float> c = values.coefficients(plan, launch, chunk.chunk);
    // amsgrad is refused with 8- and 4-bit moments (ops/adam.cc validates it
    // before any launch), so its modes have no instance here. The moments'
    // pointers are the chunk's first byte; the element index within the
    // chunk then finds the byte (a chunk starts on a whole block).
    with_mode(c, [&]<class Mode>() {
      if constexpr (!Mode::amsgrad) {
        with_scaling(values.scaled, [&]<bool Scaled>() {
          cpu::run_kernel<SpanLowBit<Codec, Weights, G, Copy, Mode, Scaled>>(
              isa, int64_t{chunk.chunk.length}, chunk.tensor<W>(0), remainder_of<Weights>(chunk, launch),
              static_cast<const G*>(chunk.tensor<G>(1)), chunk.block_tensor<uint8_t>(2, codes_per_byte),
              chunk.block_tensor<uint8_t>(3, codes_per_byte),
              chunk.block_tensor<float>(launch.absmax_list, Codec::kBlock),
              chunk.block_tensor<float>(launch.absmax_list + 1, Codec::kBlock), copy_of<Copy>(chunk, launch), codec,
              c, values.inverse_scale);
        });
      }
    });
  });
}

template <class Weights, class G, class Codec>
void run_copy_low_bit(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa, Codec codec) {
  if (launch.copy_list < 0) return run_chunks_low_bit<Codec, Weights, G, NoCopy>(plan, launch, isa, codec);
  dispatch_dtype(plan.dtype(launch.copy_list), [&]<class Copy>() {
    if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) {
      run_chunks_low_bit<Codec, Weights, G, Copy>(plan, launch, isa, codec);
    }
  });
}

// The loop for one codec and one way of storing weights, over every gradient
// dtype and model copy: four instances, each compiled in a file of its own.
template <class Codec, class Weights>
void run_low_bit(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa, Codec codec) {
  dispatch_dtype(plan.dtype(1), [&]<class G>() {
    if constexpr (!std::is_same_v<G, double>) run_copy_low_bit<Weights, G>(plan, launch, isa, codec);
  });
}

// The instances: declared here with extern, so that a file including this
// header does not compile them; each is compiled by one of adam_{8,4}bit_{plain,remainder}.cc,
// which write the same line without extern.
#define GRADKIT_CPU_ADAM_LOW_BIT(CODEC, WEIGHTS) \
  template void run_low_bit<CODEC, WEIGHTS>(const MultiTensorPlan&, const AdamLaunch&, cpu::Isa, CODEC)
extern GRADKIT_CPU_ADAM_LOW_BIT(Codec8, PlainWeights<float>);
extern GRADKIT_CPU_ADAM_LOW_BIT(Codec8, RemainderWeights);
extern GRADKIT_CPU_ADAM_LOW_BIT(Codec4, PlainWeights<float>);
extern GRADKIT_CPU_ADAM_LOW_BIT(Codec4, RemainderWeights);

}  // namespace gradkit::spec::cpu_adam
