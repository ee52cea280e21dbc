#include "train/train_command.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"
#include "options.h"
#include "train/fashion_mnist.h"
#include "train/trainer.h"

namespace gradkit::train {
namespace {

bool under_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr; }

// Starts `self train args...` under mpiexec with `ranks` ranks, one core's
// worth of threads each, and returns its exit status.
[[noreturn]] void relaunch(const std::string& self, int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"mpiexec", "-n", std::to_string(ranks), "--oversubscribe"};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  for (const char* variable : {"OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1"}) {
    argv.push_back("-x");
    argv.push_back(variable);
  }
  argv.push_back(self);
  argv.push_back("train");
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> c_argv;
  for (std::string& a : argv) c_argv.push_back(a.data());
  c_argv.push_back(nullptr);
  ::execvp("mpiexec", c_argv.data());
  std::fprintf(stderr, "gradkit train: cannot start mpiexec for %d ranks (install openmpi-bin, or pass --ranks 1)\n",
               ranks);
  std::exit(1);
}

}  // namespace

int run_train_command(const std::string& self, const std::vector<std::string>& args) {
  tool::Options options("gradkit train", "Train an MLP on Fashion-MNIST, data-parallel over MPI ranks, with gradkit doing "
                                   "everything after backward.");
  options.add("ranks", "auto", "ranks to start (auto: 2, or mpiexec's count when started under mpiexec)");
  options.add("device", "cpu", "cpu, or cuda (a GPU per rank, f16 with dynamic loss scaling, NCCL)");
  options.add("data", kDefaultDataDir, "directory of the Fashion-MNIST IDX files (Debian: dataset-fashion-mnist)");
  options.add("epochs", "12", "epochs to train");
  options.add("stop-after", "0", "stop after this epoch, keeping the schedule of --epochs (0: train all epochs)");
  options.add("batch", "64", "images per micro-batch per rank");
  options.add("accumulate", "1", "micro-batches accumulated per step");
  options.add("optimizer", "adam", "adam or lamb");
  options.add("lr", "auto", "learning rate (auto: 1e-3 for adam, 5e-3 for lamb)");
  options.add("weight-decay", "0", "weight decay (AdamW's decoupled decay; LAMB's lambda)");
  options.add("reduce", "allreduce", "how ranks combine gradients: allreduce (average) or adasum");
  options.add("seed", "1", "seed of the initial weights and the data order");
  options.add("limit", "0", "train on the first N images only (0: all 60,000)");
  options.add("save", "", "checkpoint file, written atomically after every epoch");
  options.add("resume", "", "checkpoint to continue from");
  options.add("log", "gradkit-train.csv", "CSV log of every epoch ('' for none)");
  options.add("plot", "", "PNG of the loss and accuracy curves (needs gnuplot)");
  options.add("progress", "on", "progress bar on a terminal: on or off");
  if (!options.parse(args)) return options.exit_code();

  const std::string ranks_text = options.get("ranks");
  const int ranks = ranks_text == "auto" ? 2 : static_cast<int>(options.get_int("ranks", 1, 1024));
  const std::string device = options.get_choice("device", {"cpu", "cuda"});
  if (!under_mpi() && ranks > 1) relaunch(self, ranks, args);

  TrainOptions o;
  o.data_dir = options.get("data");
  o.device = device;
  o.epochs = static_cast<int>(options.get_int("epochs", 1, 100000));
  o.stop_after = static_cast<int>(options.get_int("stop-after", 0, o.epochs));
  o.batch = static_cast<int>(options.get_int("batch", 1, 1 << 16));
  o.accumulate = static_cast<int>(options.get_int("accumulate", 1, 1 << 16));
  o.optimizer = options.get_choice("optimizer", {"adam", "lamb"});
  o.lr = options.get("lr") == "auto" ? (o.optimizer == "adam" ? 1e-3f : 5e-3f)
                                     : static_cast<float>(options.get_double("lr", 0.0, 10.0));
  o.weight_decay = static_cast<float>(options.get_double("weight-decay", 0.0, 1.0));
  o.reduce = options.get_choice("reduce", {"allreduce", "adasum"});
  o.seed = static_cast<uint64_t>(options.get_int("seed", 0, INT64_MAX));
  o.limit = options.get_int("limit", 0, INT64_MAX);
  o.save = options.get("save");
  o.resume = options.get("resume");
  o.log = options.get("log");
  o.plot = options.get("plot");
  o.progress = options.get_choice("progress", {"on", "off"}) == "on";

  int argc = 0;
  char** argv = nullptr;
  MpiEnvironment mpi(&argc, &argv);
  try {
    run_training(o);
  } catch (const Error& e) {
    std::fprintf(stderr, "gradkit train: error: %s\n", e.what());
    std::fflush(stderr);
    // One rank's error (a bad file, say) would leave the others waiting.
    std::_Exit(1);
  }
  return 0;
}

}  // namespace gradkit::train
