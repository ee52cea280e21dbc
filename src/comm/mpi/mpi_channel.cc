#include "comm/mpi/mpi_channel.h"

#include <climits>
#include <thread>

#include "comm/mpi/mpi_check.h"

namespace gradkit::comm {

namespace {

// The inverse of mpi_comm_handle, for MPI_Comm a pointer (Open MPI) or an int (MPICH).
template <class Comm>
Comm from_handle(std::uintptr_t value) {
  if constexpr (std::is_pointer_v<Comm>) return reinterpret_cast<Comm>(value);
  else return static_cast<Comm>(value);
}

}  // namespace

MPI_Comm to_mpi_comm(MpiCommHandle handle) {
  if (handle.is_world()) return MPI_COMM_WORLD;
  return from_handle<MPI_Comm>(handle.value);
}

void require_mpi_initialized(std::string_view op) {
  int initialized = 0, finalized = 0;
  GRADKIT_MPI_CHECK(MPI_Initialized(&initialized));
  GRADKIT_MPI_CHECK(MPI_Finalized(&finalized));
  if (!initialized || finalized) {
    throw Error(ErrorCode::invalid_argument,
                std::string(op) + ": MPI is " + (finalized ? "already finalized" : "not initialized") +
                    ", expected it running (call MPI_Init, or hold a gradkit::MpiEnvironment, before creating "
                    "communicators and destroy them before MPI_Finalize)");
  }
}

int mpi_count(std::string_view op, int64_t count) {
  if (count > INT_MAX) {
    throw Error(ErrorCode::invalid_argument, std::string(op) + ": " + std::to_string(count) +
                                                 " elements in one MPI call, expected at most " +
                                                 std::to_string(INT_MAX) + " (MPI counts are int)");
  }
  return static_cast<int>(count);
}

MpiChannel::MpiChannel(MpiCommHandle handle, std::chrono::milliseconds timeout) : timeout_(timeout) {
  require_mpi_initialized("create communicator");
  GRADKIT_MPI_CHECK(MPI_Comm_dup(to_mpi_comm(handle), &comm_));
  // From here on a failing call on our communicator returns its code (which
  // GRADKIT_MPI_CHECK turns into an Error) instead of aborting the job.
  GRADKIT_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  GRADKIT_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  GRADKIT_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  // Ranks that share memory are the ranks of one host: that is what picks
  // this rank's GPU, on one host or many.
  MPI_Comm local = MPI_COMM_NULL;
  GRADKIT_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local));
  const int rank_status = MPI_Comm_rank(local, &local_rank_);
  const int size_status = MPI_Comm_size(local, &local_size_);
  GRADKIT_MPI_CHECK(MPI_Comm_free(&local));
  GRADKIT_MPI_CHECK(rank_status);
  GRADKIT_MPI_CHECK(size_status);
}

MpiChannel::~MpiChannel() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  // A timed-out collective may still be pending on this communicator; it is
  // left to MPI rather than freed under it.
  if (!finalized && !abandoned_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiChannel::wait(MPI_Request& request, const char* call) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    GRADKIT_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done) return;
    if (std::chrono::steady_clock::now() - start > timeout_) {
      abandoned_ = true;
      throw Error(ErrorCode::mpi_error,
                  std::string(call) + " did not complete within " + std::to_string(timeout_.count()) +
                      " ms on rank " + std::to_string(rank_) +
                      ": another rank has not joined (it died, hangs, or makes a different call); the "
                      "communicator is unusable from now on");
    }
    std::this_thread::yield();
  }
}

void MpiChannel::wait_all(std::span<MPI_Request> requests, const char* call) {
  for (MPI_Request& request : requests) wait(request, call);
}

void MpiChannel::all_gather_bytes(const void* input, void* output, size_t bytes) {
  MPI_Request request = MPI_REQUEST_NULL;
  const int count = mpi_count("all_gather_bytes", static_cast<int64_t>(bytes));
  GRADKIT_MPI_CHECK(MPI_Iallgather(input, count, MPI_BYTE, output, count, MPI_BYTE, comm_, &request));
  wait(request, "MPI_Iallgather");
}

void MpiChannel::broadcast_bytes(void* data, size_t bytes, int root) {
  MPI_Request request = MPI_REQUEST_NULL;
  const int count = mpi_count("broadcast_bytes", static_cast<int64_t>(bytes));
  GRADKIT_MPI_CHECK(MPI_Ibcast(data, count, MPI_BYTE, root, comm_, &request));
  wait(request, "MPI_Ibcast");
}

void MpiChannel::barrier() {
  MPI_Request request = MPI_REQUEST_NULL;
  GRADKIT_MPI_CHECK(MPI_Ibarrier(comm_, &request));
  wait(request, "MPI_Ibarrier");
}

}  // namespace gradkit::comm
