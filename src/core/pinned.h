// Page-locked host memory (for asynchronous copies to and from a GPU),
// behind a plain C++ interface: src/cuda/offload_lanes.cu with CUDA,
// src/optim/offload_lanes_nocuda.cc without (backend_unavailable there).
#pragma once

#include <cstddef>
#include <memory>

namespace gradkit::detail {

// `bytes` (> 0) of zero-filled pinned host memory, freed with the last
// owner. Throws Error naming the size and CUDA's reason when it fails.
std::shared_ptr<void> allocate_pinned(size_t bytes);

}  // namespace gradkit::detail
