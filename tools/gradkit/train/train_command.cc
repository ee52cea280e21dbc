#include "train/train_command.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <sstream>

#include "gradkit/comm/communicator.h"
#include "gradkit/core/error.h"
#include "options.h"
#include "train/fashion_mnist.h"
#include "train/launcher.h"
#include "train/trainer.h"

namespace gradkit::train {
namespace {

constexpr const char* kCommand = "gradkit train";
// Set by the process that starts mpiexec, for its ranks: "1" when rank 0
// draws the progress bar, "0" when not.
constexpr const char* kBarVariable = "GRADKIT_TRAIN_PROGRESS_BAR";

bool under_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr; }

// This process's rank in the MPI job that started it (0 outside one).
int job_rank() {
  for (const char* variable : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    if (const char* rank = std::getenv(variable)) return std::atoi(rank);
  }
  return 0;
}

// Whether rank 0 draws the progress bar: only on a terminal, and which one
// is known only where the job starts, since Open MPI gives every rank a
// pseudo-terminal as stdout even when mpiexec's own stdout is a file or a
// pipe. So the process that starts mpiexec decides from its own stdout and
// tells the ranks; ranks started by another mpiexec draw no bar.
bool progress_bar(bool wanted) {
  if (!wanted) return false;
  if (!under_mpi()) return ::isatty(STDOUT_FILENO) != 0;
  const char* decided = std::getenv(kBarVariable);
  return decided != nullptr && std::string(decided) == "1";
}

std::string seconds_text(double seconds) {
  std::ostringstream out;
  out << seconds << " s";
  return out.str();
}

// Starts `self train args...` under mpiexec with `ranks` ranks, one core's
// worth of threads each, passing on whether rank 0 draws the progress bar;
// mpiexec's exit status becomes ours.
[[noreturn]] void relaunch(const std::string& self, int ranks, const std::vector<std::string>& args, bool bar) {
  std::vector<std::string> argv = {"mpiexec", "-n", std::to_string(ranks), "--oversubscribe"};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  std::vector<std::string> variables = {"OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1",
                                        std::string(kBarVariable) + (bar ? "=1" : "=0")};
  // This process becomes mpiexec: the ranks watch it (train/launcher.h).
  if (std::optional<std::string> identity = launcher_identity()) {
    variables.push_back(std::string(kLauncherVariable) + "=" + *identity);
  }
  for (const std::string& variable : variables) {
    argv.push_back("-x");
    argv.push_back(variable);
  }
  argv.push_back(self);
  argv.push_back("train");
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> c_argv;
  for (std::string& a : argv) c_argv.push_back(a.data());
  c_argv.push_back(nullptr);
  std::fflush(stdout);
  ::execvp("mpiexec", c_argv.data());
  tool::print_error(kCommand, "cannot start mpiexec for " + std::to_string(ranks) + " ranks (" +
                                  std::strerror(errno) + "; install openmpi-bin, or pass --ranks 1)");
  std::exit(tool::kExitFailure);
}

}  // namespace

int run_train_command(const std::string& self, const std::vector<std::string>& args) {
  TrainOptions o;
  o.data_dir = kDefaultDataDir;
  std::string ranks = "auto", lr = "auto", progress = "on";
  double timeout = 600;
  // Under mpiexec every rank parses the same arguments; rank 0 speaks.
  const bool report = !under_mpi() || job_rank() == 0;

  tool::Command command(kCommand, "Train an MLP on Fashion-MNIST, data-parallel over MPI ranks, with gradkit doing "
                                  "everything after backward.");
  CLI::App& app = command.app();
  app.add_option("--ranks", ranks, "ranks to start (auto: 2, or mpiexec's count when started under mpiexec)")
      ->type_name("INT|auto")
      ->check(tool::integer(1, 1024, /*allow_auto=*/true));
  app.add_option("--device", o.device, "cpu, or cuda (a GPU per rank, f16 with dynamic loss scaling, NCCL)")
      ->check(tool::one_of({"cpu", "cuda"}));
  app.add_option("--data", o.data_dir, "directory of the Fashion-MNIST IDX files (Debian: dataset-fashion-mnist)")
      ->type_name("DIR");
  app.add_option("--epochs", o.epochs, "epochs to train")->check(tool::integer(1, 100000));
  app.add_option("--stop-after", o.stop_after,
                 "stop after this epoch, keeping the schedule of --epochs (0: train all epochs)")
      ->check(tool::integer(0, 100000));
  app.add_option("--batch", o.batch, "images per micro-batch per rank")->check(tool::integer(1, 1 << 16));
  app.add_option("--accumulate", o.accumulate, "micro-batches accumulated per step")->check(tool::integer(1, 1 << 16));
  app.add_option("--optimizer", o.optimizer,
                 "adam, lamb, or muon (Muon for the weight matrices but the output layer's, Adam for the rest; "
                 "cpu, unsharded)")
      ->check(tool::one_of({"adam", "lamb", "muon"}));
  app.add_option("--moments", o.moments,
                 "optimizer moments: f32; bf16; int8 (8-bit blockwise, about 2 bytes per parameter); int4 "
                 "(4-bit blockwise, about 1 byte)")
      ->check(tool::one_of({"f32", "bf16", "int8", "int4"}));
  app.add_option("--master", o.master,
                 "f32 master weights: f32 (the cpu backend trains f32 weights, cuda keeps f32 masters of its f16 "
                 "ones); remainder (cpu: bf16 weights, each completed to its f32 master by a 16-bit remainder; "
                 "sharded or not; lamb with f32 or bf16 moments)")
      ->check(tool::one_of({"f32", "remainder"}));
  app.add_option("--lr", lr, "learning rate (auto: 1e-3 for adam, 5e-3 for lamb)")
      ->type_name("FLOAT|auto")
      ->check(tool::number(0, 10, /*allow_auto=*/true));
  app.add_option("--weight-decay", o.weight_decay, "weight decay (AdamW's decoupled decay; LAMB's lambda)")
      ->check(tool::number(0, 1));
  app.add_option("--reduce", o.reduce, "how ranks combine gradients: allreduce (average) or adasum")
      ->check(tool::one_of({"allreduce", "adasum"}));
  app.add_option("--shard", o.shard,
                 "ZeRO stage: 0 off; 1 optimizer state split across ranks; 2 also gradients reduce-scattered per "
                 "bucket as they are ready (--reduce allreduce)")
      ->check(tool::integer(0, 2));
  app.add_flag("--offload", o.offload,
               "keep the optimizer state in host memory and run the optimizer's step on the CPU, overlapped "
               "with the copies (--device cuda)");
  app.add_option("--seed", o.seed, "seed of the initial weights and the data order")
      ->check(tool::integer(0, INT64_MAX));
  app.add_option("--limit", o.limit, "train on the first N images only (0: all 60,000)")
      ->check(tool::integer(0, INT64_MAX));
  app.add_option("--save", o.save, "checkpoint file, written atomically after every epoch")->type_name("FILE");
  app.add_option("--resume", o.resume, "checkpoint to continue from")->type_name("FILE");
  app.add_option("--log", o.log, "CSV log of every epoch ('' for none; a resumed run appends to it)")
      ->type_name("FILE");
  app.add_option("--plot", o.plot, "PNG of the loss and accuracy curves (needs gnuplot and --log)")
      ->type_name("FILE");
  app.add_option("--progress", progress, "progress bar when the output is a terminal: on or off")
      ->check(tool::one_of({"on", "off"}));
  app.add_option("--timeout", timeout,
                 "seconds a rank waits for the others in a collective before the run fails (a rank that "
                 "stopped or hangs)")
      ->type_name("SECONDS")
      ->check(tool::number(0.001, 7 * 24 * 3600));
  // Checked where the job starts, before mpiexec and before any work.
  app.callback([&] { check_train_options(o, /*writes=*/report); });
  if (std::optional<int> status = command.parse(args, report)) return *status;

  o.lr = lr != "auto" ? std::stof(lr) : o.optimizer == "adam" ? 1e-3f : 5e-3f;
  o.timeout = std::chrono::milliseconds(std::llround(timeout * 1000));
  o.progress = progress_bar(progress == "on");
  if (!under_mpi()) {
    const int count = ranks == "auto" ? 2 : std::stoi(ranks);
    if (count > 1) relaunch(self, count, args, o.progress);
  }

  if (under_mpi()) watch_launcher(kCommand);
  int argc = 0;
  char** argv = nullptr;
  MpiEnvironment mpi(&argc, &argv);
  try {
    run_training(o);
  } catch (const Error& e) {
    std::string message = e.what();
    if (e.code() == ErrorCode::mpi_error || e.code() == ErrorCode::nccl_error) {
      message += " (--timeout " + seconds_text(timeout) + ")";
    }
    tool::print_error(kCommand, message);
    // One rank's error (a bad file, say) would leave the others waiting.
    std::_Exit(tool::kExitFailure);
  } catch (const std::exception& e) {  // not gradkit's (the standard library's): said, not an abort
    tool::print_error(kCommand, e.what());
    std::_Exit(tool::kExitFailure);
  }
  return 0;
}

}  // namespace gradkit::train
