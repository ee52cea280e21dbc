// gradkit: the command-line tool.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "bench.h"
#ifdef GRADKIT_WITH_TRAIN
#include "train/train_command.h"
#endif
#include "gradkit/core/error.h"

namespace {

void usage() {
  std::printf(
      "usage: gradkit <command> [options]\n\n"
      "commands:\n"
#ifdef GRADKIT_WITH_TRAIN
      "  train   train an MLP on Fashion-MNIST, data-parallel, with gradkit after backward\n"
#endif
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
#ifdef GRADKIT_WITH_TRAIN
    if (command == "train") {
      // mpiexec must start this very binary: resolve our own path now.
      char self[4096];
      const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
      self[n > 0 ? n : 0] = '\0';
      return gradkit::train::run_train_command(n > 0 ? self : argv[0], args);
    }
#endif
    std::fprintf(stderr, "gradkit: unknown command '%s'\n", command.c_str());
    usage();
    return 2;
  } catch (const gradkit::Error& e) {
    std::fprintf(stderr, "gradkit %s: error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
