// gradkit: the command-line tool.
#include <cstdio>
#include <string>
#include <vector>

#include "bench.h"
#include "gradkit/core/error.h"

namespace {

void usage() {
  std::printf(
      "usage: gradkit <command> [options]\n\n"
      "commands:\n"
      "  bench   time gradkit's operations against the copy bandwidth and PyTorch\n\n"
      "'gradkit <command> --help' lists a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (command == "bench") return gradkit::tool::run_bench(args);
    std::fprintf(stderr, "gradkit: unknown command '%s'\n", command.c_str());
    usage();
    return 2;
  } catch (const gradkit::Error& e) {
    std::fprintf(stderr, "gradkit %s: error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
