// The host exchanges that a communicator borrows from another engine for
// what its ranks must agree on outside its own collectives (checked mode's
// fingerprints, Adasum's layout check, barrier): the NCCL communicator
// bootstrapped over MPI keeps its MpiChannel (mpi/mpi_channel.h) as one.
// Its users need no MPI header. Every call is bounded by the channel's
// timeout and throws an Error on failure.
#pragma once

#include <cstddef>

namespace gradkit::comm {

class HostChannel {
 public:
  virtual ~HostChannel() = default;
  // Each rank's `bytes` from `input` land at rank * bytes in `output`.
  virtual void all_gather_bytes(const void* input, void* output, size_t bytes) = 0;
  // Returns when every rank has called it.
  virtual void barrier() = 0;
};

}  // namespace gradkit::comm
