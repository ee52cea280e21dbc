// The gradient check each backend implements: a pass that leaves per-chunk
// partials (sum of squares of the unscaled values, or their max magnitude,
// in f64, and whether any value was not finite), then a finalize step that
// combines them in chunk order into per-tensor norms, the global norm, the
// found-inf flag and the gradient divisor.
#pragma once

#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/ops/grad_check.h"

namespace gradkit::spec {

struct GradCheckLaunch {
  GradientCheckOptions options;
  GradientCheckOutputs outputs;
  float loss_scale = 1.0f;
  const float* loss_scale_device = nullptr;
  double* partial_norms;   // one per chunk
  bool* partial_flags;     // one per chunk
};

void grad_check_cpu(const MultiTensorPlan& plan, const GradCheckLaunch& launch);
void grad_check_cuda(const MultiTensorPlan& plan, const GradCheckLaunch& launch, Stream stream);

// The outputs from `count` lists' partials (launch.outputs.partial's layout),
// combined in index order; partial_norms and partial_flags are unused.
void grad_check_combine_cpu(const double* partials, int count, const GradCheckLaunch& launch);
void grad_check_combine_cuda(Device device, const double* partials, int count, const GradCheckLaunch& launch,
                             Stream stream);

}  // namespace gradkit::spec
