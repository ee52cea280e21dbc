// Page-locked host memory (for asynchronous copies to and from a GPU),
// behind a plain C++ interface: src/cuda/runtime.cu with CUDA,
// src/core/no_cuda.cc without (backend_unavailable there).
#pragma once

#include <cstddef>
#include <memory>

namespace gradkit::detail {

// `bytes` (> 0) of zero-filled pinned host memory, freed with the last
// owner (Buffer::pinned's): map_host's pages, mapped by every core at
// once, then page-locked with cudaHostRegister, which only has to pin pages
// that exist. Throws Error naming the size and the reason (CUDA's, or the
// host's) when it fails. `huge_pages`: as map_host's.
std::shared_ptr<void> allocate_registered(size_t bytes, bool huge_pages = true);

// The same from cudaHostAlloc, which maps and pins every page in one
// thread of the driver (tens of GB take tens of seconds: bench/log/2026-11-26.md, "Start-up"). Kept
// for bench/offload_startup.cc's comparison; defined in
// src/cuda/offload_lanes.cu (src/optim/no_cuda.cc).
std::shared_ptr<void> allocate_pinned(size_t bytes);

}  // namespace gradkit::detail
