// `gradkit train` and `gradkit bench` as a user runs them: their command
// lines, errors and exit statuses, the progress bar under mpiexec, and a rank
// that stops without dying. Each test runs the real binary (GRADKIT_TOOL).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "train/fashion_mnist.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Result {
  int status = -1;  // the exit status; -1 if killed or timed out
  std::string out, err;
};

std::string temp(const std::string& name) { return ::testing::TempDir() + "gradkit_cli_" + name; }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

bool have_dataset() {
  return std::ifstream(std::string(gradkit::train::kDefaultDataDir) + "/train-images-idx3-ubyte.gz").good();
}

[[noreturn]] void exec_gradkit(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {GRADKIT_TOOL};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> c_argv;
  for (std::string& a : argv) c_argv.push_back(a.data());
  c_argv.push_back(nullptr);
  ::execv(c_argv[0], c_argv.data());
  ::_exit(127);
}

// Starts `gradkit args...` in a process group of its own, its stdout and
// stderr going to files (no terminal), stdin from /dev/null.
pid_t start(const std::vector<std::string>& args, const std::string& out, const std::string& err) {
  std::remove(out.c_str());  // an earlier run's words are not this one's
  std::remove(err.c_str());
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(::open("/dev/null", O_RDONLY), STDIN_FILENO);
    ::dup2(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), STDOUT_FILENO);
    ::dup2(::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), STDERR_FILENO);
    exec_gradkit(args);
  }
  return pid;
}

// Waits for `pid` until `deadline`. Past it, asks it to end (mpiexec then
// ends its ranks), and a few seconds later kills its process group. Returns
// its exit status, or -1 if it did not exit by itself.
int finish(pid_t pid, Clock::time_point deadline) {
  int wstatus = 0;
  bool timed_out = false;
  while (::waitpid(pid, &wstatus, WNOHANG) == 0) {
    const auto now = Clock::now();
    if (!timed_out && now > deadline) {
      timed_out = true;
      ::kill(pid, SIGTERM);
    } else if (timed_out && now > deadline + 5s) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &wstatus, 0);
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  return !timed_out && WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
}

Result run(const std::vector<std::string>& args) {
  const std::string out = temp("stdout.txt"), err = temp("stderr.txt");
  Result r;
  r.status = finish(start(args, out, err), Clock::now() + 120s);
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

// Runs `gradkit args...` with a pseudo-terminal as stdin, stdout and stderr;
// `out` gets all it wrote.
Result run_on_terminal(const std::vector<std::string>& args) {
  int master = -1;
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, nullptr);
  if (pid == 0) exec_gradkit(args);
  Result r;
  const auto deadline = Clock::now() + 120s;
  char buffer[4096];
  for (;;) {
    pollfd p{master, POLLIN, 0};
    if (::poll(&p, 1, 100) > 0) {
      const ssize_t n = ::read(master, buffer, sizeof buffer);
      if (n <= 0) break;  // EIO: the terminal's last writer is gone
      r.out.append(buffer, static_cast<size_t>(n));
    } else if (Clock::now() > deadline) {
      break;
    }
  }
  ::close(master);
  r.status = finish(pid, deadline);
  return r;
}

// The processes under `root` (its children, theirs, ...).
std::vector<pid_t> descendants(pid_t root) {
  std::multimap<pid_t, pid_t> children;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    // "pid (comm) state ppid ...", where comm may hold spaces and parentheses.
    const std::string text = read_file(entry.path() / "stat");
    const size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 1));
    std::string state;
    pid_t parent = 0;
    rest >> state >> parent;
    children.emplace(parent, std::stoi(name));
  }
  std::vector<pid_t> out, todo = {root};
  while (!todo.empty()) {
    const pid_t p = todo.back();
    todo.pop_back();
    for (auto [it, end] = children.equal_range(p); it != end; ++it) {
      out.push_back(it->second);
      todo.push_back(it->second);
    }
  }
  return out;
}

bool has_variable(pid_t pid, const std::string& assignment) {
  const std::string environ = read_file("/proc/" + std::to_string(pid) + "/environ");
  return environ.starts_with(assignment + '\0') || environ.find('\0' + assignment + '\0') != std::string::npos;
}

bool alive(pid_t pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t close = stat.rfind(')');
  return close != std::string::npos && stat.size() > close + 2 && stat[close + 2] != 'Z';
}

// 1. Errors name the command once, on stderr, with exit status 2 for a bad
// command line and 1 for a failure at run time.
TEST(Errors, NameTheCommandOnce) {
  Result r = run({"train", "--epochs", "-1"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(count(r.err, "gradkit train"), 1u) << r.err;
  EXPECT_NE(r.err.find("gradkit train: error: --epochs: expected an integer from 1 to 100000, not '-1'"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;

  // A failure at run time (the data directory), through the library's error.
  r = run({"train", "--ranks", "1", "--data", temp("nowhere"), "--log", ""});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(count(r.err, "gradkit train"), 1u) << r.err;
  EXPECT_NE(r.err.find("gradkit train: error: data file"), std::string::npos) << r.err;

  r = run({"bench", "--reps", "0"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count(r.err, "gradkit bench"), 1u) << r.err;
  EXPECT_NE(r.err.find("gradkit bench: error: --reps: expected auto or an integer from 1 to 100000, not '0'"),
            std::string::npos)
      << r.err;
  r = run({"bench", "--device", "gpu"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count(r.err, "gradkit bench"), 1u) << r.err;
  EXPECT_NE(r.err.find("--device: expected cpu, cuda or cuda:N"), std::string::npos) << r.err;
  // A failure at run time: PyTorch asked for and not run.
  r = run({"bench", "--ops", "zero", "--workloads", "small", "--scale", "4096", "--reps", "1", "--torch", "on",
           "--torch-script", temp("no_such_script.py")});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(count(r.err, "gradkit bench"), 1u) << r.err;
  EXPECT_NE(r.err.find("gradkit bench: error: --torch on, but PyTorch did not run"), std::string::npos) << r.err;

  r = run({"nonsense"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err.rfind("gradkit: error: unknown command 'nonsense'", 0), 0u) << r.err;
  r = run({"train", "--help"});
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--timeout"), std::string::npos) << r.out;
  EXPECT_EQ(r.err, "");
}

// 2. An option without its value says so, and never takes the next option
// as its value.
TEST(Errors, AnOptionWithoutItsValue) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"train", "--epochs", "--ranks", "1"}, "gradkit train: error: --epochs needs a value"},
      {{"train", "--ranks", "1", "--epochs"}, "gradkit train: error: --epochs needs a value"},
      {{"train", "--save", "--ranks", "1"}, "gradkit train: error: --save needs a value"},
      {{"train", "--log", "-h"}, "gradkit train: error: --log needs a value"},
      {{"bench", "--reps", "--ops", "zero"}, "gradkit bench: error: --reps needs a value"}};
  for (const auto& [args, expected] : cases) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 2) << expected;
    EXPECT_EQ(r.out, "") << expected;
    EXPECT_EQ(r.err.rfind(expected, 0), 0u) << r.err;
  }
  // Values that start with a dash: a negative number is a value; `--name=`
  // gives an empty one (--log= means no log) without taking the next.
  Result r = run({"train", "--log=", "--epochs", "0"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--epochs: expected an integer from 1 to 100000, not '0'"), std::string::npos) << r.err;
  r = run({"train", "--lr", "-0.5"});
  EXPECT_NE(r.err.find("--lr: expected auto or a number from 0 to 10, not '-0.5'"), std::string::npos) << r.err;
}

// 3. Files the run would write are checked before any work, on 1 rank and
// before mpiexec starts more.
TEST(Files, UnwritablePathsAreRefusedBeforeTraining) {
  for (const char* ranks : {"1", "2"}) {
    Result r = run({"train", "--ranks", ranks, "--save", "/proc/nope/ck"});
    EXPECT_EQ(r.status, 2);
    EXPECT_EQ(r.out, "");  // nothing loaded, nothing trained
    EXPECT_EQ(r.err,
              "gradkit train: error: --save: cannot write '/proc/nope/ck': no file can be created in '/proc/nope' "
              "(No such file or directory)\n");
    r = run({"train", "--ranks", ranks, "--save", "/proc/ck"});  // a directory that takes no files
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.err.find("--save: cannot write '/proc/ck': no file can be created in '/proc'"), std::string::npos)
        << r.err;
  }
  Result r = run({"train", "--ranks", "1", "--log", "/proc/nope/log.csv"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--log: cannot write '/proc/nope/log.csv'"), std::string::npos) << r.err;
  r = run({"train", "--ranks", "1", "--plot", "/proc/nope/curves.png"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--plot: cannot write"), std::string::npos) << r.err;
  r = run({"train", "--ranks", "1", "--save", ::testing::TempDir()});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("it is a directory"), std::string::npos) << r.err;
  r = run({"train", "--ranks", "1", "--resume", temp("no_such.ckpt")});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--resume: state file '" + temp("no_such.ckpt") + "': cannot be opened (No such file"),
            std::string::npos)
      << r.err;
  r = run({"bench", "--csv", "/proc/nope/bench.csv"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--csv: cannot write"), std::string::npos) << r.err;
}

// 3a. What --resume names must be a state file, and --save's temporary
// file must fit the file system's names: both known before any work.
TEST(Files, WhatCannotBeResumedOrSavedIsRefusedBeforeTraining) {
  const std::string text = temp("not_a_checkpoint.csv");
  std::ofstream(text) << "epoch,train_loss\n1,0.5\n";
  const std::string directory = ::testing::TempDir();
  const std::vector<std::pair<std::string, std::string>> resumes = {
      {directory, "': is a directory"},
      {"/dev/zero", "': is not a regular file"},  // read whole, it would fill the memory
      {text, "': is not a gradkit state file (bad magic)"}};
  // A name that fits, whose temporary (NAME.tmp.PID) does not.
  const std::string long_name = directory + "/" + std::string(250, 'c');
  for (const char* ranks : {"1", "2"}) {
    for (const auto& [path, why] : resumes) {
      const Result r = run({"train", "--ranks", ranks, "--resume", path});
      EXPECT_EQ(r.status, 2) << path << ": " << r.err;
      EXPECT_EQ(r.out, "");  // nothing loaded, nothing trained
      EXPECT_EQ(r.err.rfind("gradkit train: error: --resume: state file '" + path + why, 0), 0u) << r.err;
    }
    const Result r = run({"train", "--ranks", ranks, "--save", long_name, "--log", ""});
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_NE(r.err.find("--save: cannot write '" + long_name + "': the name of the temporary file written beside "
                         "it, '" + std::string(250, 'c') + ".tmp."),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("is too long for the file system"), std::string::npos) << r.err;
  }
  std::remove(text.c_str());
}

// 3b. --moments and --master: a bad value or a combination that cannot
// work is refused before any work (status 2); a run with both trains and
// says how it keeps its state.
TEST(StateOptions, AreCheckedFirstAndTrain) {
  Result r = run({"train", "--ranks", "1", "--moments", "int2"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("gradkit train: error: --moments: expected one of f32, bf16, int8, int4, not 'int2'"),
            std::string::npos)
      << r.err;
  r = run({"train", "--ranks", "1", "--optimizer", "muon", "--moments", "int8"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("--optimizer muon: cannot be used with --moments int8 or int4"), std::string::npos) << r.err;
  r = run({"train", "--ranks", "2", "--master", "remainder", "--device", "cuda"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("--master remainder: needs bf16 weights"), std::string::npos) << r.err;
  r = run({"train", "--ranks", "1", "--master", "remainder", "--optimizer", "lamb", "--moments", "int8"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--master remainder: --optimizer lamb needs --moments f32 or bf16"), std::string::npos) << r.err;
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  r = run({"train", "--ranks", "2", "--epochs", "1", "--limit", "1024", "--log", "", "--moments", "int8", "--master",
           "remainder"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("(bf16 weights, remainder masters), adam with int8 moments"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("epoch 1/1: train loss"), std::string::npos) << r.out;
  r = run({"train", "--ranks", "2", "--epochs", "1", "--limit", "1024", "--log", "", "--moments", "int8", "--shard",
           "2", "--optimizer", "lamb"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("lamb with int8 moments, sharded"), std::string::npos) << r.out;
  r = run({"train", "--ranks", "1", "--epochs", "1", "--limit", "1024", "--log", "", "--master", "remainder",
           "--optimizer", "lamb"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("(bf16 weights, remainder masters), lamb"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("epoch 1/1: train loss"), std::string::npos) << r.out;
}

// 4. The progress bar is drawn only when the output of `gradkit train` is a
// terminal, though under mpiexec every rank's stdout is one.
TEST(Progress, BarOnlyOnTheLaunchersTerminal) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const std::vector<std::string> args = {"train", "--epochs", "1", "--limit", "1024", "--log", "", "--progress", "on"};
  for (const char* ranks : {"1", "2"}) {
    std::vector<std::string> with_ranks = args;
    with_ranks.insert(with_ranks.end(), {"--ranks", ranks});
    const Result piped = run(with_ranks);
    EXPECT_EQ(piped.status, 0) << piped.err;
    EXPECT_NE(piped.out.find("epoch 1/1: train loss"), std::string::npos) << piped.out;
    EXPECT_EQ(piped.out.find('\r'), std::string::npos) << ranks << " ranks:\n" << piped.out;
    EXPECT_EQ(piped.out.find('\033'), std::string::npos) << piped.out;
  }
  std::vector<std::string> two = args;
  two.insert(two.end(), {"--ranks", "2"});
  const Result terminal = run_on_terminal(two);
  EXPECT_EQ(terminal.status, 0) << terminal.out;
  EXPECT_NE(terminal.out.find("\repoch 1/1 ["), std::string::npos) << terminal.out;
}

// 5. A rank that stops without dying: the others give up after --timeout,
// say so, and mpiexec ends the job (the stopped rank included).
TEST(Timeout, AStoppedRankEndsTheRunAfterTheTimeout) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const std::string out = temp("timeout_stdout.txt"), err = temp("timeout_stderr.txt");
  const pid_t pid = start({"train", "--ranks", "2", "--epochs", "1000", "--limit", "8192", "--log", "", "--progress",
                           "off", "--timeout", "3"},
                          out, err);
  pid_t stopped = 0;
  struct Cleanup {  // whatever fails below, leave no process behind
    pid_t& rank;
    pid_t job;
    ~Cleanup() {
      if (rank != 0 && alive(rank)) ::kill(rank, SIGKILL);
      if (alive(job)) finish(job, Clock::now());
    }
  } cleanup{stopped, pid};
  // Once rank 0 prints the header, both ranks have their communicator.
  const auto give_up = Clock::now() + 60s;
  while (read_file(out).find("gradkit train: MLP") == std::string::npos && Clock::now() < give_up) {
    std::this_thread::sleep_for(20ms);
  }
  for (pid_t p : descendants(pid)) {
    if (has_variable(p, "OMPI_COMM_WORLD_RANK=1")) stopped = p;
  }
  ASSERT_NE(stopped, 0) << "rank 1 not found\n" << read_file(out) << read_file(err);
  ASSERT_EQ(::kill(stopped, SIGSTOP), 0);
  const auto at_stop = Clock::now();
  const int status = finish(pid, at_stop + 60s);
  const double seconds = std::chrono::duration<double>(Clock::now() - at_stop).count();
  const std::string errors = read_file(err);
  EXPECT_EQ(status, 1) << errors;
  EXPECT_GE(seconds, 2.5);
  EXPECT_LT(seconds, 30) << "mpiexec did not end";
  EXPECT_NE(errors.find("gradkit train: error: "), std::string::npos) << errors;
  EXPECT_NE(errors.find("within 3000 ms"), std::string::npos) << errors;
  EXPECT_NE(errors.find("(--timeout 3 s)"), std::string::npos) << errors;
  // mpiexec takes the stopped rank down with it.
  const auto gone_by = Clock::now() + 10s;
  while (alive(stopped) && Clock::now() < gone_by) std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(alive(stopped)) << "the stopped rank outlived mpiexec";
}

// 6. An epoch's log line follows its checkpoint: a run that fails (or is
// killed) between the two has not logged the epoch that a resumed run
// trains again, so that every epoch is logged once.
TEST(Checkpoints, AnEpochIsLoggedOnlyOnceItsCheckpointIsWritten) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const std::filesystem::path directory = temp("checkpoints");
  std::filesystem::remove_all(directory);
  std::filesystem::create_directories(directory);
  const std::string save = (directory / "run.ckpt").string(), log = temp("checkpoints.csv");
  const std::vector<std::string> args = {"train", "--ranks", "1", "--epochs", "2", "--limit", "1024", "--progress",
                                         "off", "--save", save, "--log", log};
  // The first save fails: a directory has the name of its temporary file
  // (one rank: the process that trains is the one started).
  const std::string out = temp("checkpoints_stdout.txt"), err = temp("checkpoints_stderr.txt");
  const pid_t pid = start(args, out, err);
  const std::filesystem::path blocker = save + ".tmp." + std::to_string(pid);
  std::filesystem::create_directory(blocker);
  EXPECT_EQ(finish(pid, Clock::now() + 120s), 1) << read_file(err);
  EXPECT_NE(read_file(err).find("cannot create '" + blocker.string() + "'"), std::string::npos) << read_file(err);
  EXPECT_EQ(read_file(log), "epoch,train_loss,test_accuracy,samples_per_second,seconds\n");
  EXPECT_EQ(read_file(out).find("epoch 1/2:"), std::string::npos) << read_file(out);
  std::filesystem::remove(blocker);
  // Stopped after epoch 1, then resumed: each epoch once in the log.
  std::vector<std::string> first = args;
  first.insert(first.end(), {"--stop-after", "1"});
  Result r = run(first);
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<std::string> resumed = args;
  resumed.insert(resumed.end(), {"--resume", save});
  r = run(resumed);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string lines = read_file(log);
  EXPECT_EQ(count(lines, "\n1,"), 1u) << lines;
  EXPECT_EQ(count(lines, "\n2,"), 1u) << lines;
  EXPECT_EQ(count(lines, "\n"), 3u) << lines;
  std::filesystem::remove_all(directory);
  std::remove(log.c_str());
}

// The ranks of a run on 2 ranks, once rank 0 has printed its header (both
// have their communicator then); empty if that does not come in a minute.
std::vector<pid_t> ranks_of(pid_t job, const std::string& out) {
  const auto give_up = Clock::now() + 60s;
  while (read_file(out).find("gradkit train: MLP") == std::string::npos && Clock::now() < give_up) {
    std::this_thread::sleep_for(20ms);
  }
  std::vector<pid_t> ranks;
  for (pid_t p : descendants(job)) {
    if (has_variable(p, "OMPI_COMM_WORLD_RANK=0") || has_variable(p, "OMPI_COMM_WORLD_RANK=1")) ranks.push_back(p);
  }
  return ranks;
}

// Seconds until none of `pids` is alive, or `limit` if some still are then.
double seconds_until_gone(const std::vector<pid_t>& pids, std::chrono::seconds limit) {
  const auto start = Clock::now();
  auto any_alive = [&] {
    for (pid_t p : pids) {
      if (alive(p)) return true;
    }
    return false;
  };
  while (any_alive() && Clock::now() < start + limit) std::this_thread::sleep_for(20ms);
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// 7. The ranks end with the launcher: killed with SIGKILL (which it cannot
// pass on), it leaves no rank training; and a signal to the job's process
// group reaches every rank. (Without a watch of their own, Open MPI's ranks
// notice mpiexec's end after about a second: the bound is below that.)
TEST(Launcher, TheRanksEndWithIt) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  // Muon's epochs are long (seconds on 2 cores): ranks that outlived the
  // launcher would go on until the end of the first.
  const std::vector<std::string> args = {"train", "--ranks", "2", "--epochs", "1000", "--optimizer", "muon", "--log",
                                         "", "--progress", "off"};
  const std::string out = temp("launcher_stdout.txt"), err = temp("launcher_stderr.txt");
  for (int signal : {SIGKILL, SIGTERM}) {
    const pid_t pid = start(args, out, err);
    const std::vector<pid_t> ranks = ranks_of(pid, out);
    struct Cleanup {  // whatever fails below, leave no process behind
      pid_t job;
      ~Cleanup() { ::kill(-job, SIGKILL); }
    } cleanup{pid};
    ASSERT_EQ(ranks.size(), 2u) << read_file(out) << read_file(err);
    if (signal == SIGKILL) {
      ASSERT_EQ(::kill(pid, SIGKILL), 0);  // the launcher alone, as `kill -9 PID` does
    } else {
      ASSERT_EQ(::kill(-pid, SIGTERM), 0);  // the job's group, as `kill -- -PGID` does
    }
    ::waitpid(pid, nullptr, 0);
    const double seconds = seconds_until_gone(ranks, 20s);
    EXPECT_LT(seconds, 0.6) << strsignal(signal) << ": the ranks outlived the launcher\n" << read_file(err);
  }
}

}  // namespace
