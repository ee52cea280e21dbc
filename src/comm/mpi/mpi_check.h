// Every MPI call is checked; a failure throws with the call, MPI's own
// description and the place. Communicators gradkit uses have the
// MPI_ERRORS_RETURN handler, so a failing call returns here instead of
// aborting the job.
#pragma once

#include <mpi.h>

#include <string>

#include "gradkit/core/error.h"

namespace gradkit::comm {

[[noreturn]] inline void throw_mpi_error(int status, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) length = 0;
  int error_class = status;
  MPI_Error_class(status, &error_class);
  throw Error(ErrorCode::mpi_error, std::string(call) + " failed: error " + std::to_string(status) + " (class " +
                                        std::to_string(error_class) + ": " + std::string(text, length) + ") at " +
                                        file + ":" + std::to_string(line));
}

}  // namespace gradkit::comm

#define GRADKIT_MPI_CHECK(call)                                                     \
  do {                                                                              \
    const int gradkit_mpi_status_ = (call);                                         \
    if (gradkit_mpi_status_ != MPI_SUCCESS)                                         \
      ::gradkit::comm::throw_mpi_error(gradkit_mpi_status_, #call, __FILE__, __LINE__); \
  } while (0)
