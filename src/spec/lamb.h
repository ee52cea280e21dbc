// The LAMB kernels each backend implements over a validated plan whose lists
// are weights, grads, exp_avg, exp_avg_sq, then model_copy, update, the two
// absmax lists and weight_remainder where present (their list index, or -1).
//
// Pass 1 reads w, g, m, v; writes the new m, v; and leaves per-chunk partial
// sums of w^2 and d^2. Where d is not finite, it keeps the old m and v and
// marks the element by setting the sign bit of its stored v (v >= 0
// otherwise). Between the passes, each tensor's partials are summed in chunk
// order into its trust ratio. Pass 2 reads w, m, v; recomputes d (bit for bit
// as pass 1 did); writes w (or the delta, and the copy); and clears the mark
// of a marked element, whose update is 0. A split step (inputs.split) runs
// pass 1 and writes each tensor's two sums out (first), or takes the ratios
// from sums combined elsewhere and runs pass 2 (second).
//
// With 8- or 4-bit moments (absmax_list >= 0) the passes work block by block
// and the mark is per block (spec/lamb_low_bit.h); the per-chunk
// partials are each block's sums (in the order of the lanes that own it: a
// warp, or a half-warp for 4-bit blocks) added in block order.
//
// With a remainder list (bf16 weights, float moments), w is the f32 master
// join_master(weight, remainder) wherever the passes read it, and pass 2
// writes split_master(w_new) to both lists: every operation is the f32
// master's, in the same order, so the master is the f32 path's bit for bit.
#pragma once

#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/ops/lamb.h"

namespace gradkit::spec {

struct QuantTables;   // spec/low_bit_int8_math.h
struct QuantTables4;  // spec/low_bit_int4_math.h

struct LambLaunch {
  const LambHyperparameters* groups;  // on the plan's device (host memory for the CPU)
  LambStepInputs inputs;
  const bool* do_update = nullptr;    // device flag (resolved from inputs.do_update)
  double* partials;                   // 2 per chunk: sum w^2, sum d^2
  float* ratios;                      // 1 per tensor
  int copy_list = -1;
  int update_list = -1;
  int absmax_list = -1;                   // 8- or 4-bit moments: m's absmax list, v's at absmax_list + 1
  int moment_bits = 0;                    // 8 or 4 with u8 moments
  const QuantTables* tables = nullptr;    // the 8-bit code tables, on the plan's device
  const QuantTables4* tables4 = nullptr;  // the 4-bit ones
  int remainder_list = -1;              // bf16 weights: the remainder list (float moments only)
};

void lamb_cpu(const MultiTensorPlan& plan, const LambLaunch& launch);
void lamb_cuda(const MultiTensorPlan& plan, const LambLaunch& launch, Stream stream);
// 8- or 4-bit moments, called by lamb_cuda: pass 1 (moments and partials) and pass 2.
void lamb_low_bit_norms_cuda(const MultiTensorPlan& plan, const LambLaunch& launch, Stream stream);
void lamb_low_bit_update_cuda(const MultiTensorPlan& plan, const LambLaunch& launch, Stream stream);

}  // namespace gradkit::spec
