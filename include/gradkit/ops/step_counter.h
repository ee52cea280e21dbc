// A step counter that lives with the optimizer state on the device, so that
// a step skipped for an overflow (found_inf, known only on the device) does
// not advance t, and a captured CUDA graph advances it on each replay.
#pragma once

#include <cstdint>

#include "gradkit/core/device.h"

namespace gradkit {

// *counter += 1 unless `skip` is given and *skip; both in memory on `device`
// (host memory for the CPU, where it happens now; enqueued on `stream` for
// CUDA). The owning optimizers count this way; a framework layer that drives
// AdamPlan with `step_device` calls it before each step.
void advance_step(int64_t* counter, Device device, const bool* skip = nullptr, Stream stream = {});

}  // namespace gradkit
