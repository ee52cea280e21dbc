// The CUDA streams and host work of an offloaded optimizer step, behind a
// plain C++ interface so that optim/ compiles without CUDA headers.
// Implemented in src/cuda/offload_lanes.cu, or by
// src/optim/no_cuda.cc in a build without CUDA (where making
// one throws backend_unavailable).
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "gradkit/core/device.h"

namespace gradkit::detail {

// Two non-blocking streams of one device, gradients to the host and
// weights to the device, and `slots` events that mark a point of a lane for
// the host worker to wait on. Ordering between the lanes and the caller's
// stream goes through events: only host_wait() and synchronize() block.
class OffloadLanes {
 public:
  enum Lane : int { to_host = 0, to_device = 1 };

  // Throws backend_unavailable naming `op` unless `device` can be used.
  OffloadLanes(std::string_view op, Device device, int slots);
  ~OffloadLanes();
  OffloadLanes(const OffloadLanes&) = delete;
  OffloadLanes& operator=(const OffloadLanes&) = delete;

  void wait_for(Lane lane, Stream caller);  // `lane` waits for the caller's work so far
  void make_wait(Stream caller, Lane lane); // the caller's stream waits for `lane`'s work so far
  // An asynchronous copy (either direction; pinned host memory) on `lane`.
  void copy(Lane lane, void* destination, const void* source, size_t bytes);
  void record(Lane lane, int slot);  // slot `slot` marks `lane`'s work so far
  void host_wait(int slot);          // blocks until that work has completed
  void synchronize();                // blocks until both lanes are idle
  Stream stream(Lane lane) const;    // the lane's stream (for a caller's allocator)

  struct Impl;  // the streams and events (public so that helpers can free them)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradkit::detail
