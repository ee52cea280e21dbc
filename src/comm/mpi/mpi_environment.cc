#include "comm/mpi/mpi_check.h"
#include "gradkit/comm/communicator.h"

namespace gradkit {

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) {
  int initialized = 0;
  GRADKIT_MPI_CHECK(MPI_Initialized(&initialized));
  if (initialized) return;
  // gradkit calls MPI from one thread at a time; FUNNELED is all it needs.
  int provided = 0;
  GRADKIT_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
  owns_ = true;
}

MpiEnvironment::~MpiEnvironment() {
  int finalized = 0;
  if (owns_ && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Finalize();
}

}  // namespace gradkit
