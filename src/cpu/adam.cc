// The Adam update on the CPU: the same per-element formula as the CUDA
// kernel (backend/adam_math.h), over the plan's chunks.
#include <type_traits>

#include "backend/adam.h"
#include "backend/adam_math.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::backend {
namespace {

struct NoCopy {};

template <class W, class G, class M, class Copy>
void run(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  using C = cpu::compute_t<W>;
  const AdamStepInputs& in = launch.inputs;
  const C scale = static_cast<C>(in.grad_scale_device != nullptr ? *in.grad_scale_device : in.grad_scale);
  const bool scaled = scale != C(1);
  const int64_t step = in.step_device != nullptr ? *in.step_device : in.step;
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    const int group = plan.groups()[chunk.chunk.tensor];
    const AdamHyperparameters& h = launch.groups[group];
    const double lr = in.lr_device != nullptr ? in.lr_device[group] : h.lr;
    const AdamCoefficients<C> c = adam_coefficients<C>(h, lr, step);
    W* w = chunk.tensor<W>(0);
    const G* g = chunk.tensor<G>(1);
    M* m = chunk.tensor<M>(2);
    M* v = chunk.tensor<M>(3);
    M* vmax = c.amsgrad ? chunk.tensor<M>(launch.max_list) : nullptr;
    for (int i = 0; i < chunk.chunk.length; ++i) {
      C wc = cpu::to_compute<C>(w[i]);
      C gc = cpu::to_compute<C>(g[i]);
      if (scaled) gc = gc / scale;
      C mc = cpu::to_compute<C>(m[i]), vc = cpu::to_compute<C>(v[i]);
      C vmaxc = vmax != nullptr ? cpu::to_compute<C>(vmax[i]) : C(0);
      adam_element(wc, gc, mc, vc, vmaxc, c);
      w[i] = cpu::from_compute<W>(wc);
      m[i] = cpu::from_compute<M>(mc);
      v[i] = cpu::from_compute<M>(vc);
      if (vmax != nullptr) vmax[i] = cpu::from_compute<M>(vmaxc);
      if constexpr (!std::is_same_v<Copy, NoCopy>) chunk.tensor<Copy>(launch.copy_list)[i] = cpu::from_compute<Copy>(wc);
    }
  });
}

template <class W, class G, class M>
void run_with_copy(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  if (launch.copy_list < 0) return run<W, G, M, NoCopy>(plan, launch);
  dispatch_dtype(plan.dtype(launch.copy_list), [&]<class Copy>() {
    if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) run<W, G, M, Copy>(plan, launch);
  });
}

}  // namespace

void adam_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  if (launch.inputs.found_inf != nullptr && *launch.inputs.found_inf) return;
  if (plan.dtype(0) == DType::f64) return run<double, double, double, NoCopy>(plan, launch);
  dispatch_dtype(plan.dtype(1), [&]<class G>() {
    dispatch_dtype(plan.dtype(2), [&]<class M>() {
      if constexpr (!std::is_same_v<G, double> && (std::is_same_v<M, float> || std::is_same_v<M, bfloat16>)) {
        run_with_copy<float, G, M>(plan, launch);
      }
    });
  });
}

}  // namespace gradkit::backend
