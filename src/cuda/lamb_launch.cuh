// What the LAMB kernels of both moment storages share (cuda/lamb.cu,
// cuda/lamb_low_bit.cu): whether the step writes anything, and the chunk's
// group coefficients.
#pragma once

#include "spec/lamb.h"
#include "spec/lamb_math.h"
#include "cuda/multi_tensor.cuh"

namespace gradkit::cuda {

using spec::LambCoefficients;
using spec::LambLaunch;

// Whether this step writes anything; every kernel of the step asks.
__device__ __forceinline__ bool step_enabled(const LambLaunch& l) {
  if (l.do_update != nullptr && !*l.do_update) return false;
  return l.inputs.found_inf == nullptr || !*l.inputs.found_inf;
}

// The group's coefficients, computed by thread 0 and shared with the block.
template <class C>
__device__ __forceinline__ LambCoefficients<C> block_coefficients(const PlanArgs& plan, const PlanChunk& chunk,
                                                                  const LambLaunch& l) {
  __shared__ LambCoefficients<C> shared;
  if (threadIdx.x == 0) {
    const LambStepInputs& in = l.inputs;
    const LambHyperparameters& h = l.groups[plan.groups[chunk.tensor]];
    const double eta = in.eta_device != nullptr ? *in.eta_device : in.eta;
    const double scale = in.loss_scale_device != nullptr ? *in.loss_scale_device : in.loss_scale;
    const double norm = in.gradient_norm_device != nullptr ? *in.gradient_norm_device : in.gradient_norm;
    const int64_t step = in.step_device != nullptr ? *in.step_device : in.step;
    shared = spec::lamb_coefficients<C>(h, eta, scale, norm, step);
  }
  __syncthreads();
  return shared;
}

}  // namespace gradkit::cuda
