#pragma once

#include <string>
#include <vector>

namespace gradkit::tool {

// `gradkit bench ...`: returns the process exit code.
int run_bench(const std::vector<std::string>& args);

}  // namespace gradkit::tool
