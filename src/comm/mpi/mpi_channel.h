// gradkit's own duplicate of an MPI communicator, with MPI_ERRORS_RETURN, and
// the host-side exchanges both communicators build on (the NCCL one uses it
// to bootstrap, for checked mode and for barriers). Every wait is bounded by
// the timeout: MPI calls are started non-blocking and polled, so a rank that
// never joins makes the others throw instead of hanging.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <span>
#include <string>

#include "comm/host_channel.h"
#include "gradkit/comm/communicator.h"

namespace gradkit::comm {

// The MPI_Comm behind a handle (0 is MPI_COMM_WORLD).
MPI_Comm to_mpi_comm(MpiCommHandle handle);

// Throws invalid_argument naming `op` unless MPI is initialized and not finalized.
void require_mpi_initialized(std::string_view op);

class MpiChannel final : public HostChannel {
 public:
  MpiChannel(MpiCommHandle handle, std::chrono::milliseconds timeout);
  ~MpiChannel() override;
  MpiChannel(const MpiChannel&) = delete;
  MpiChannel& operator=(const MpiChannel&) = delete;

  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }

  // Polls `request` until it completes; after the timeout, throws mpi_error
  // naming `call` and keeps the request (a collective cannot be cancelled):
  // the owner must then treat the communicator as unusable.
  void wait(MPI_Request& request, const char* call);
  void wait_all(std::span<MPI_Request> requests, const char* call);

  void all_gather_bytes(const void* input, void* output, size_t bytes) override;
  void broadcast_bytes(void* data, size_t bytes, int root);
  void barrier() override;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  std::chrono::milliseconds timeout_;
  bool abandoned_ = false;  // a request timed out and is still pending
};

// An element count as MPI's int, or an invalid_argument error naming `op`.
int mpi_count(std::string_view op, int64_t count);

}  // namespace gradkit::comm
