// The CPU Adam loop over 8-bit moments with bf16 weights with remainders: one of
// cpu/adam_low_bit.h's four instances, in a file of its own.
#include "cpu/adam_low_bit.h"

namespace gradkit::spec::cpu_adam {
GRADKIT_CPU_ADAM_LOW_BIT(Codec8, RemainderWeights);
}  // namespace gradkit::spec::cpu_adam
