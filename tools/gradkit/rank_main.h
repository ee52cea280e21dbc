// The main of a benchmark run under mpiexec: MPI for the program's
// lifetime, the report (and --help) printed by rank 0 alone, every rank's
// errors printed with its rank, and an error on any rank ending the whole
// job (MPI_Abort) rather than leaving the others waiting in a collective.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <exception>
#include <string>

#include "cli.h"
#include "gradkit/comm/communicator.h"

namespace gradkit::tool {

// run(argc, argv, report) -> exit status; `report`: this rank prints.
template <class Run>
int rank_main(const char* program, int argc, char** argv, Run&& run) {
  MpiEnvironment mpi(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
  try {
    return run(argc, argv, /*report=*/rank == 0);
  } catch (const std::exception& e) {
    print_error(std::string(program) + " (rank " + std::to_string(rank) + ")", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}

}  // namespace gradkit::tool
