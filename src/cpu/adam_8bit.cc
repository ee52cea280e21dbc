// The Adam update with 8-bit blockwise moments on the CPU: block by block,
// m and v decoded, every element updated by the shared formula
// (backend/adam_math.h, its folded form), then the block encoded again with its new absmax
// (backend/quant_tables.h), as the CUDA kernel does; one loop per
// instruction set (isa.h), every per-launch choice a template parameter.
#include <algorithm>
#include <type_traits>

#include "backend/quant_tables.h"
#include "cpu/adam_kernel.h"
#include "cpu/quant_avx512.h"

namespace gradkit::backend {
namespace cpu_adam {
namespace {

// A block's decode and encode: with AVX-512's permutes in the AVX-512 copy
// (quant_avx512.h), else as loops that GCC vectorizes as it can.
inline void decode(const QuantTable& t, const uint8_t* q, float absmax, int n, float* out, bool avx512) {
#if GRADKIT_CPU_MULTI_ISA
  if (avx512) return cpu::decode_avx512(t, q, absmax, n, out);
#endif
  (void)avx512;
  for (int k = 0; k < n; ++k) out[k] = dequantize(t, q[k], absmax);
}

inline void encode(const QuantTable& t, const float* values, int n, uint8_t* codes, float* absmax, bool avx512) {
#if GRADKIT_CPU_MULTI_ISA
  if (avx512) return cpu::encode_avx512(t, values, n, codes, absmax);
#endif
  (void)avx512;
  encode_block(t, values, n, codes, absmax);
}

// One chunk (whole blocks: the plan's chunks are multiples of kQuantBlock).
template <class Weights, class G, class Copy, class Mode, bool Scaled>
struct Span8bit {
  using W = typename Weights::Stored;
  static void run(int64_t n, W* __restrict w, int16_t* __restrict r, const G* __restrict g, uint8_t* __restrict qm,
                  uint8_t* __restrict qv, float* __restrict absmax_m, float* __restrict absmax_v,
                  Copy* __restrict copy, const QuantTables* tables, AdamCoefficients<float> c, float inverse_scale,
                  bool avx512) {
    const QuantTable& code_m = tables->table[0];
    const QuantTable& code_v = tables->table[1];
    alignas(64) float m_old[kQuantBlock], v_old[kQuantBlock], m_new[kQuantBlock], v_new[kQuantBlock];
    for (int64_t b = 0; b * kQuantBlock < n; ++b) {
      const int64_t base = b * kQuantBlock;
      const int count = static_cast<int>(std::min<int64_t>(kQuantBlock, n - base));
      decode(code_m, qm + base, absmax_m[b], count, m_old, avx512);
      decode(code_v, qv + base, absmax_v[b], count, v_old, avx512);
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
      encode(code_m, m_new, count, qm + base, absmax_m + b, avx512);
      encode(code_v, v_new, count, qv + base, absmax_v + b, avx512);
    }
  }
};

template <class Weights, class G, class Copy>
void run(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  using W = typename Weights::Stored;
  const StepValues<float> values(launch.inputs);
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    const AdamCoefficients<float> c = values.coefficients(plan, launch, chunk.chunk);
    // amsgrad is refused with 8-bit moments (ops/adam.cc validates it before
    // any launch), so its modes have no instance here.
    with_mode(c, [&]<class Mode>() {
      if constexpr (!Mode::amsgrad) {
        with_scaling(values.scaled, [&]<bool Scaled>() {
          cpu::run_kernel<Span8bit<Weights, G, Copy, Mode, Scaled>>(
              isa, int64_t{chunk.chunk.length}, chunk.tensor<W>(0), remainder_of<Weights>(chunk, launch),
              static_cast<const G*>(chunk.tensor<G>(1)), chunk.tensor<uint8_t>(2), chunk.tensor<uint8_t>(3),
              chunk.block_tensor<float>(launch.absmax_list, kQuantBlock),
              chunk.block_tensor<float>(launch.absmax_list + 1, kQuantBlock), copy_of<Copy>(chunk, launch),
              launch.tables, c, values.inverse_scale, isa == cpu::Isa::avx512);
        });
      }
    });
  });
}

template <class Weights, class G>
void run_copy(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  if (launch.copy_list < 0) return run<Weights, G, NoCopy>(plan, launch, isa);
  dispatch_dtype(plan.dtype(launch.copy_list), [&]<class Copy>() {
    if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) run<Weights, G, Copy>(plan, launch, isa);
  });
}

template <class Weights>
void run_weights(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  dispatch_dtype(plan.dtype(1), [&]<class G>() {
    if constexpr (!std::is_same_v<G, double>) run_copy<Weights, G>(plan, launch, isa);
  });
}

}  // namespace
}  // namespace cpu_adam

void adam_8bit_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  using namespace cpu_adam;
  if (launch.remainder_list >= 0) return run_weights<RemainderWeights>(plan, launch, isa);
  run_weights<PlainWeights<float>>(plan, launch, isa);
}

}  // namespace gradkit::backend
