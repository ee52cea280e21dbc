// One host thread that runs tasks in the order they were posted: the CPU
// half of an offloaded step (wait for a bucket's copy, step it, enqueue its
// copy-back) runs there while the caller goes on with backward.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace gradkit::detail {

class HostWorker {
 public:
  HostWorker();
  ~HostWorker();  // finishes the posted tasks, then joins
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;

  // Queues `task`. After a task has thrown, later tasks are dropped until
  // wait() has reported the error.
  void post(std::function<void()> task);
  // Blocks until every posted task has run; rethrows the first error of
  // those tasks (once).
  void wait();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable posted_, idle_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false, stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started once the rest is ready
};

// The number of OpenMP threads the calling thread's parallel loops use:
// `threads`, or 0 for every core but two (at least one). A no-op without
// OpenMP.
void set_host_threads(int threads);

}  // namespace gradkit::detail
