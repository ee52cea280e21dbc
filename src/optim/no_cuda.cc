// The offloaded step's CUDA pieces in a build without CUDA: pinned memory
// and the side streams are refused with a clear error, never emulated.
#include <string>

#include "core/pinned.h"
#include "gradkit/core/error.h"
#include "optim/offload_lanes.h"

namespace gradkit::detail {

std::shared_ptr<void> allocate_pinned(size_t bytes) {
  throw Error(ErrorCode::backend_unavailable, "Buffer::pinned: cannot allocate " + std::to_string(bytes) +
                                                  " bytes of pinned host memory: gradkit was built without CUDA");
}

struct OffloadLanes::Impl {};

OffloadLanes::OffloadLanes(std::string_view op, Device, int) {
  throw Error(ErrorCode::backend_unavailable,
              std::string(op) + ": the offloaded step needs CUDA, and gradkit was built without it");
}
OffloadLanes::~OffloadLanes() = default;

// Never reached: no OffloadLanes can be made.
void OffloadLanes::wait_for(Lane, Stream) {}
void OffloadLanes::make_wait(Stream, Lane) {}
void OffloadLanes::copy(Lane, void*, const void*, size_t) {}
void OffloadLanes::record(Lane, int) {}
void OffloadLanes::host_wait(int) {}
void OffloadLanes::synchronize() {}
Stream OffloadLanes::stream(Lane) const { return {}; }

}  // namespace gradkit::detail
