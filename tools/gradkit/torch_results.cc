#include "torch_results.h"

#include <cstdio>
#include <fstream>
#include <sstream>

namespace gradkit::tool {

std::map<std::string, double> read_torch_results(const std::string& path, const std::string& program) {
  std::map<std::string, double> results;
  if (path.empty()) return results;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "%s: cannot read --torch-results %s; no torch column\n", program.c_str(), path.c_str());
    return results;
  }
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key;
    double ms = 0;
    if (fields >> key >> ms && ms > 0) results[key] = ms;
  }
  return results;
}

}  // namespace gradkit::tool
