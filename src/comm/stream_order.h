// Orders work on one CUDA stream after the work queued so far on another
// (an event recorded on `producer`, waited on by `waiter`), without blocking
// the host. Implemented with the NCCL communicator; a build without it
// throws backend_unavailable, since only NCCL communicators use streams.
#pragma once

#include "gradkit/core/device.h"

namespace gradkit::comm {

void stream_wait(Device device, Stream waiter, Stream producer);

}  // namespace gradkit::comm
