// The dtype rules Adam and LAMB share: weights, grads, first and second
// moments at list indices 0..3, then the optional lists.
#pragma once

#include <string_view>

#include "gradkit/core/multi_tensor_plan.h"

namespace gradkit::ops {

struct OptionalLists {
  int max_exp_avg_sq = -1;  // must match the moments
  int model_copy = -1;      // f16 or bf16
  int update = -1;          // the weights' dtype
};

// Weights f32 with grads f32/f16/bf16 and moments f32 or bf16 (all alike),
// or everything f64 (no model copy). Throws dtype_unsupported naming `op`
// and the list.
void check_optimizer_dtypes(std::string_view op, const MultiTensorPlan& plan, const OptionalLists& lists);

}  // namespace gradkit::ops
