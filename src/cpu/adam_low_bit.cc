// The CPU Adam update with 8- or 4-bit blockwise moments: picks the
// instance of the loop (cpu/adam_low_bit.h) for the codes and the weights.
#include "cpu/adam_low_bit.h"

namespace gradkit::spec {
namespace cpu_adam {
namespace {

template <class Codec>
void run_codec(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa, Codec codec) {
  if (launch.remainder_list >= 0) return run_low_bit<Codec, RemainderWeights>(plan, launch, isa, codec);
  run_low_bit<Codec, PlainWeights<float>>(plan, launch, isa, codec);
}

}  // namespace
}  // namespace cpu_adam

void adam_int8_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  cpu_adam::run_codec(plan, launch, isa, cpu_adam::Codec8::of(launch, isa));
}

void adam_int4_cpu(const MultiTensorPlan& plan, const AdamLaunch& launch, cpu::Isa isa) {
  cpu_adam::run_codec(plan, launch, isa, cpu_adam::Codec4::of(launch, isa));
}

}  // namespace gradkit::spec
