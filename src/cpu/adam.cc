// The Adam update on the CPU: picks the loop (cpu/adam_float_moments.h; 8-
// and 4-bit moments: adam_low_bit.cc) and its instance for the weights.
#include "cpu/adam_float_moments.h"
#include "cpu/isa.h"

namespace gradkit::spec {

void adam_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch) {
  using namespace cpu_adam;
  const cpu::Isa isa = cpu::active_isa();  // before anything is written: it may throw
  if (launch.inputs.found_inf != nullptr && *launch.inputs.found_inf) return;
  if (plan.dtype(0) == DType::f64) return run<PlainWeights<double>, double, double, NoCopy>(plan, launch, isa);
  if (launch.absmax_list >= 0) {
    return launch.moment_bits == 4 ? adam_int4_cpu(plan, launch, isa) : adam_int8_cpu(plan, launch, isa);
  }
  if (launch.remainder_list >= 0) return run_weights<RemainderWeights>(plan, launch, isa);
  run_weights<PlainWeights<float>>(plan, launch, isa);
}

}  // namespace gradkit::spec
