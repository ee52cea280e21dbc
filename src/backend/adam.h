// The Adam kernels each backend implements, over a validated plan whose lists
// are weights, grads, exp_avg, exp_avg_sq, then max_exp_avg_sq and
// model_copy where present (their list index, or -1).
#pragma once

#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/ops/adam.h"

namespace gradkit::backend {

struct AdamLaunch {
  const AdamHyperparameters* groups;  // on the plan's device (host memory for the CPU)
  AdamStepInputs inputs;
  int max_list = -1;
  int copy_list = -1;
};

void adam_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch);
void adam_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream);

}  // namespace gradkit::backend
