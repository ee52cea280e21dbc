// gradkit: the command-line tool.
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench.h"
#ifdef GRADKIT_WITH_TRAIN
#include "train/train_command.h"
#endif
#include "cli.h"

namespace {

// On stdout when asked for, on stderr when a command is missing.
void usage(std::FILE* out) {
  std::fprintf(out,
      "usage: gradkit <command> [options]\n\n"
      "commands:\n"
#ifdef GRADKIT_WITH_TRAIN
      "  train   train an MLP on Fashion-MNIST, data-parallel, with gradkit after backward\n"
#endif
      "  bench   time gradkit's operations against the copy and triad bandwidths and PyTorch\n\n"
      "'gradkit <command> --help' lists a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? gradkit::tool::kExitUsage : 0;
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
    gradkit::tool::print_error("gradkit", "unknown command '" + command + "' (see gradkit --help)");
    return gradkit::tool::kExitUsage;
  } catch (const std::exception& e) {  // gradkit::Error, or the standard library's: said, never an abort
    gradkit::tool::print_error("gradkit " + command, e.what());
    return gradkit::tool::kExitFailure;
  }
}
