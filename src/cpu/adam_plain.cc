// The CPU Adam loop over float moments with f32 weights: one of
// cpu/adam_float_moments.h's two instances, in a file of its own.
#include "cpu/adam_float_moments.h"

namespace gradkit::spec::cpu_adam {
GRADKIT_CPU_ADAM(PlainWeights<float>);
}  // namespace gradkit::spec::cpu_adam
