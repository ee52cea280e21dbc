#pragma once

#include <string>
#include <vector>

namespace gradkit::train {

// `gradkit train ...`: returns the process exit code. Started outside MPI
// with more than one rank, it starts itself again under mpiexec.
int run_train_command(const std::string& self, const std::vector<std::string>& args);

}  // namespace gradkit::train
