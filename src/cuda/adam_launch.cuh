// The dtype dispatch the Adam kernels share (float moments in cuda/adam.cu,
// 8- and 4-bit moments in cuda/adam_low_bit.cu): weights f32 or bf16 with their
// remainder, gradients f32/f16/bf16, moments f32 or bf16, model copy none,
// f16 or bf16. Kernel<Weights, G, M, Copy>::launch is instantiated for each
// combination the validation lets through (host element types; NoCopy for
// no copy; RemainderWeights for bf16 weights with a remainder).
#pragma once

#include <type_traits>

#include "spec/adam.h"
#include "spec/adam_math.h"
#include "cuda/multi_tensor.cuh"
#include "gradkit/core/dtype.h"

namespace gradkit::cuda {

// The constants of the chunk's group for this step (one thread computes
// them and shares them with its block).
template <class C>
__device__ __forceinline__ spec::AdamCoefficients<C> chunk_coefficients(const PlanArgs& plan, const PlanChunk& chunk,
                                                                           const spec::AdamLaunch& launch) {
  const AdamStepInputs& in = launch.inputs;
  const int group = plan.groups[chunk.tensor];
  const AdamHyperparameters& h = launch.groups[group];
  const double lr = in.lr_device != nullptr ? in.lr_device[group] : h.lr;
  const int64_t step = in.step_device != nullptr ? *in.step_device : in.step;
  return spec::adam_coefficients<C>(h, lr, step);
}

struct NoCopy {};
struct RemainderWeights {};

template <template <class, class, class, class> class Kernel>
void dispatch_adam(const MultiTensorPlan& plan, const spec::AdamLaunch& launch, Stream stream) {
  auto with_weights = [&]<class Weights>() {
    dispatch_dtype(plan.dtype(1), [&]<class G>() {
      if constexpr (!std::is_same_v<G, double>) {
        // 8-bit moments take the f32 branch (the type is unused there).
        const DType m = plan.dtype(2) == DType::u8 ? DType::f32 : plan.dtype(2);
        dispatch_dtype(m, [&]<class M>() {
          if constexpr (std::is_same_v<M, float> || std::is_same_v<M, bfloat16>) {
            if (launch.copy_list < 0) return Kernel<Weights, G, M, NoCopy>::launch(plan, launch, stream);
            if constexpr (!std::is_same_v<Weights, RemainderWeights>) {
              dispatch_dtype(plan.dtype(launch.copy_list), [&]<class Copy>() {
                if constexpr (std::is_same_v<Copy, half> || std::is_same_v<Copy, bfloat16>) {
                  Kernel<Weights, G, M, Copy>::launch(plan, launch, stream);
                }
              });
            }
          }
        });
      }
    });
  };
  if (launch.remainder_list >= 0) with_weights.template operator()<RemainderWeights>();
  else with_weights.template operator()<float>();
}

}  // namespace gradkit::cuda
