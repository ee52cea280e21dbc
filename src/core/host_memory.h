// Zero-filled host memory for Buffer (src/core/memory.cc) and for pinned
// buffers (src/core/pinned.h), made fast for the tens of GB an offloaded
// optimizer holds (bench/log/2026-11-26.md, "Start-up").
#pragma once

#include <cstddef>
#include <memory>

namespace gradkit::detail {

// `bytes` (> 0) of zero-filled host memory, aligned to 256 bytes, freed
// with the last owner; empty when the host has no such memory. Below 32 MiB
// from malloc (and memset), above from map_host.
std::shared_ptr<void> allocate_host(size_t bytes, bool huge_pages = true);

// `bytes` (> 0) of pages of its own (shared with no other allocation, so
// that cudaHostRegister may pin them and unpin them alone), aligned to
// 2 MiB, freed with the last owner; empty when the host has none. They come
// from mmap, whose anonymous pages the kernel guarantees zero, advised as
// transparent huge pages (fewer, cheaper page faults, fewer pages for
// cudaHostRegister to pin and for the CPU step's TLB), and are first
// touched by every core in parallel: the page faults of tens of GB are
// tens of seconds of one thread's work (measured: bench/log/2026-11-26.md,
// "Start-up"). `huge_pages` false leaves the pages at the system's default
// (for bench/offload_startup.cc's comparison).
std::shared_ptr<void> map_host(size_t bytes, bool huge_pages = true);

}  // namespace gradkit::detail
