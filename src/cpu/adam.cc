// The Adam update on the CPU: the same per-element formula as the CUDA
// kernel (backend/adam_math.h), over the plan's chunks in vector loops
// (cpu/adam_strip.h, docs/cpu-kernels.md); with 8-bit moments,
// block by block, decoded and encoded as the CUDA kernel does
// (backend/blockwise_math.h).
#include <algorithm>
#include <type_traits>

#include "backend/adam.h"
#include "backend/adam_math.h"
#include "backend/master_math.h"
#include "backend/quant_tables.h"
#include "cpu/adam_strip.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::backend {
namespace {

struct NoCopy {};

// How the weights are stored: as they are (f32, f64), or as bf16 weights
// whose f32 master is completed by the remainder list (master_math.h).
// load/store move one element (the 8-bit loop); load_strip/store_strip a
// strip in the compute type (the vector loop, cpu/vector_loop.h).
template <class W>
struct PlainWeights {
  using C = cpu::compute_t<W>;
  W* w;
  PlainWeights(const cpu::ChunkView& chunk, const AdamLaunch&) : w(chunk.tensor<W>(0)) {}
  C load(int64_t i) const { return cpu::to_compute<C>(w[i]); }
  void store(int64_t i, C x) const { w[i] = cpu::from_compute<W>(x); }
  C* load_strip(int64_t base, int n, C* buffer) const { return cpu::load_strip(w + base, buffer, n); }
  void store_strip(int64_t base, int n, const C* values) const { cpu::store_strip(values, w + base, n); }
};

// The remainder master joined and split a strip at a time, in vector loops.
GRADKIT_CPU_CLONES void join_strip(const uint16_t* __restrict w, const int16_t* __restrict r, float* __restrict out,
                                   int n) {
  for (int k = 0; k < n; ++k) out[k] = join_master(w[k], r[k]);
}

GRADKIT_CPU_CLONES void split_strip(const float* __restrict in, uint16_t* __restrict w, int16_t* __restrict r, int n) {
  for (int k = 0; k < n; ++k) split_master(in[k], w[k], r[k]);
}

struct RemainderWeights {
  using C = float;
  uint16_t* w;
  int16_t* r;
  RemainderWeights(const cpu::ChunkView& chunk, const AdamLaunch& launch)
      : w(chunk.tensor<uint16_t>(0)), r(chunk.tensor<int16_t>(launch.remainder_list)) {}
  float load(int64_t i) const { return join_master(w[i], r[i]); }
  void store(int64_t i, float x) const { split_master(x, w[i], r[i]); }
  float* load_strip(int64_t base, int n, float* buffer) const {
    join_strip(w + base, r + base, buffer, n);
    return buffer;
  }
  void store_strip(int64_t base, int n, const float* values) const { split_strip(values, w + base, r + base, n); }
};

// The step's per-launch values and one chunk's group constants.
template <class C>
struct StepValues {
  C scale;
  bool scaled;
  int64_t step;
  explicit StepValues(const AdamStepInputs& in)
      : scale(static_cast<C>(in.grad_scale_device != nullptr ? *in.grad_scale_device : in.grad_scale)),
        scaled(scale != C(1)),
        step(in.step_device != nullptr ? *in.step_device : in.step) {}

  AdamCoefficients<C> coefficients(const MultiTensorPlan& plan, const AdamLaunch& launch, const PlanChunk& chunk) const {
    const int group = plan.groups()[chunk.tensor];
    const AdamHyperparameters& h = launch.groups[group];
    const double lr = launch.inputs.lr_device != nullptr ? launch.inputs.lr_device[group] : h.lr;
    return adam_coefficients<C>(h, lr, step);
  }
  C grad(C g) const { return scaled ? g / scale : g; }
};

// Strips of kStrip elements: each tensor that is not in the compute type is
// converted into a buffer of the thread's own (L1-sized), the update runs
// over the strip in one vector loop picked for the chunk's flags, and the
// results are converted back. Tensors already in the compute type (f32
// weights and moments) are updated in place, with no copy.
constexpr int kStrip = 512;

template <class Weights, class G, class M, class Copy>
void run(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  using C = typename Weights::C;
  const StepValues<C> values(launch.inputs);
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    const AdamCoefficients<C> c = values.coefficients(plan, launch, chunk.chunk);
    const cpu::AdamStripFunction<C> update = cpu::adam_strip_function(c, values.scaled);
    const Weights w(chunk, launch);
    const G* g = chunk.tensor<G>(1);
    M* m = chunk.tensor<M>(2);
    M* v = chunk.tensor<M>(3);
    M* vmax = c.amsgrad ? chunk.tensor<M>(launch.max_list) : nullptr;
    Copy* copy = nullptr;
    if constexpr (!std::is_same_v<Copy, NoCopy>) copy = chunk.tensor<Copy>(launch.copy_list);
    alignas(64) C wb[kStrip], gb[kStrip], mb[kStrip], vb[kStrip], xb[kStrip];
    for (int64_t base = 0; base < chunk.chunk.length; base += kStrip) {
      const int n = static_cast<int>(std::min<int64_t>(kStrip, chunk.chunk.length - base));
      C* ws = w.load_strip(base, n, wb);
      const C* gs = cpu::load_strip(g + base, gb, n);
      C* ms = cpu::load_strip(m + base, mb, n);
      C* vs = cpu::load_strip(v + base, vb, n);
      C* xs = vmax != nullptr ? cpu::load_strip(vmax + base, xb, n) : nullptr;
      update(ws, gs, ms, vs, xs, n, c, values.scale);
      w.store_strip(base, n, ws);
      cpu::store_strip(ms, m + base, n);
      cpu::store_strip(vs, v + base, n);
      if (vmax != nullptr) cpu::store_strip(xs, vmax + base, n);
      if constexpr (!std::is_same_v<Copy, NoCopy>) cpu::convert_strip(ws, copy + base, n);
    }
  });
}

// 8-bit moments: each block's elements decoded, updated, and the block
// encoded again with its new absmax (chunks hold whole blocks).
template <class Weights, class G, class Copy>
void run_quantized(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  const StepValues<float> values(launch.inputs);
  const QuantTable& code_m = launch.tables->table[0];
  const QuantTable& code_v = launch.tables->table[1];
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    const AdamCoefficients<float> c = values.coefficients(plan, launch, chunk.chunk);
    const Weights w(chunk, launch);
    const G* g = chunk.tensor<G>(1);
    uint8_t* qm = chunk.tensor<uint8_t>(2);
    uint8_t* qv = chunk.tensor<uint8_t>(3);
    float* absmax_m = chunk.block_tensor<float>(launch.absmax_list, kQuantBlock);
    float* absmax_v = chunk.block_tensor<float>(launch.absmax_list + 1, kQuantBlock);
    Copy* copy = nullptr;
    if constexpr (!std::is_same_v<Copy, NoCopy>) copy = chunk.tensor<Copy>(launch.copy_list);
    float m_new[kQuantBlock], v_new[kQuantBlock];
    for (int64_t b = 0; b * kQuantBlock < chunk.chunk.length; ++b) {
      const int64_t base = b * kQuantBlock;
      const int n = static_cast<int>(std::min<int64_t>(kQuantBlock, chunk.chunk.length - base));
      for (int k = 0; k < n; ++k) {
        const int64_t i = base + k;
        float wc = w.load(i);
        const float gc = values.grad(cpu::to_compute<float>(g[i]));
        float mc = dequantize(code_m, qm[i], absmax_m[b]), vc = dequantize(code_v, qv[i], absmax_v[b]), unused = 0;
        adam_element(wc, gc, mc, vc, unused, c);
        w.store(i, wc);
        if constexpr (!std::is_same_v<Copy, NoCopy>) copy[i] = cpu::from_compute<Copy>(wc);
        m_new[k] = mc;
        v_new[k] = vc;
      }
      encode_block(code_m, m_new, n, qm + base, absmax_m + b);
      encode_block(code_v, v_new, n, qv + base, absmax_v + b);
    }
  });
}

template <class Weights, class G, class M>
void run_moments(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  auto with_copy = [&]<class Copy>() {
    if (launch.absmax_list >= 0) run_quantized<Weights, G, Copy>(plan, launch);
    else run<Weights, G, M, Copy>(plan, launch);
  };
  if (launch.copy_list < 0) return with_copy.template operator()<NoCopy>();
  dispatch_dtype(plan.dtype(launch.copy_list), [&]<class Copy>() {
    if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) with_copy.template operator()<Copy>();
  });
}

template <class Weights>
void run_weights(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  dispatch_dtype(plan.dtype(1), [&]<class G>() {
    if constexpr (!std::is_same_v<G, double>) {
      // 8-bit moments take the f32 branch (their type is unused there).
      const DType m = plan.dtype(2) == DType::u8 ? DType::f32 : plan.dtype(2);
      dispatch_dtype(m, [&]<class M>() {
        if constexpr (std::is_same_v<M, float> || std::is_same_v<M, bfloat16>) run_moments<Weights, G, M>(plan, launch);
      });
    }
  });
}

}  // namespace

void adam_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  if (launch.inputs.found_inf != nullptr && *launch.inputs.found_inf) return;
  if (plan.dtype(0) == DType::f64) return run<PlainWeights<double>, double, double, NoCopy>(plan, launch);
  if (launch.remainder_list >= 0) return run_weights<RemainderWeights>(plan, launch);
  run_weights<PlainWeights<float>>(plan, launch);
}

}  // namespace gradkit::backend
