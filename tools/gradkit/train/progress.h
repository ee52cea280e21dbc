// Progress of an epoch: a bar redrawn in place on a terminal, nothing but
// the epoch's summary line otherwise (logs stay readable). Whether the output
// is a terminal is the caller's to know (train_command.cc: under mpiexec,
// only the process that started it can tell).
#pragma once

#include <chrono>
#include <string>

namespace gradkit::train {

class Progress {
 public:
  // `report`: this rank prints (the summary always, the bar too when `bar`
  // is set).
  Progress(bool report, bool bar, int epoch, int epochs, int64_t steps);
  // After step `done` (1-based) with the running mean loss.
  void update(int64_t done, double loss);
  // Ends the bar and prints the epoch's summary.
  void finish(const std::string& summary);

 private:
  bool report_;
  bool bar_;
  int epoch_, epochs_;
  int64_t steps_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace gradkit::train
