#include "gradkit/ops/step_counter.h"

#include "spec/step_counter.h"
#include "ops/device_scalar.h"

namespace gradkit {

void advance_step(int64_t* counter, Device device, const bool* skip, Stream stream) {
  ops::check_device_scalar("advance_step", "counter", counter, device, /*optional=*/false);
  ops::check_device_scalar("advance_step", "skip", skip, device);
  spec::increment_counter(device, counter, skip, stream);
}

}  // namespace gradkit
