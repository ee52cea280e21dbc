// The Adam kernels each backend implements, over a validated plan whose lists
// are weights, grads, exp_avg, exp_avg_sq, then max_exp_avg_sq, model_copy,
// the two absmax lists of 8-bit moments and the weights' remainder where
// present (their list index, or -1).
#pragma once

#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/ops/adam.h"

namespace gradkit::spec {

struct QuantTables;   // spec/low_bit_int8_math.h
struct QuantTables4;  // spec/low_bit_int4_math.h

struct AdamLaunch {
  const AdamHyperparameters* groups;  // on the plan's device (host memory for the CPU)
  AdamStepInputs inputs;
  int max_list = -1;
  int copy_list = -1;
  int absmax_list = -1;               // 8- or 4-bit moments: m's absmax list, v's at absmax_list + 1
  int moment_bits = 0;                // 8 or 4 with u8 moments
  int remainder_list = -1;            // bf16 weights: the remainder list
  const QuantTables* tables = nullptr;    // the 8-bit code tables, on the plan's device
  const QuantTables4* tables4 = nullptr;  // the 4-bit ones
};

void adam_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch);
void adam_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream);
// 8-bit moments (launch.moment_bits == 8), called by adam_cuda; 4-bit ones.
void adam_int8_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream);
void adam_int4_cuda(const MultiTensorPlan& plan, const AdamLaunch& launch, Stream stream);

}  // namespace gradkit::spec
