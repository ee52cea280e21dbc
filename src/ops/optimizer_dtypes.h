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
  int weight_remainder = -1;  // i16, with bf16 weights (and no model copy, no update)
  bool u8_moments = false;    // does the op take 8-bit moments?
};

// Weights f32 with grads f32/f16/bf16 and moments f32 or bf16 (all alike;
// or u8 where the op takes them), or everything f64 (no model copy); or
// weights bf16 with an i16 remainder (no model copy) and grads and moments
// as for f32 weights. Throws dtype_unsupported naming `op`
// and the list.
void check_optimizer_dtypes(std::string_view op, const MultiTensorPlan& plan, const OptionalLists& lists);

// The absmax lists of 8-bit moments: one tensor per weight when the moments
// are u8 (`quantized`), none otherwise. Checked before the plan is made
// (which checks each tensor's size, dtype and device). Throws naming the list.
void check_absmax_lists(std::string_view op, size_t num_weights, size_t exp_avg_absmax, size_t exp_avg_sq_absmax,
                        bool quantized);

// The tensor lists' moment_bits: 8 or 4, and 4 only with u8 moments
// (`quantized`). Throws invalid_argument naming "moment_bits".
void check_moment_bits(std::string_view op, int32_t bits, bool quantized);

}  // namespace gradkit::ops
