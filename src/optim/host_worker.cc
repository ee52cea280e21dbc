#include "optim/host_worker.h"

#include <algorithm>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace gradkit::detail {

HostWorker::HostWorker() : thread_([this] { run(); }) {}

HostWorker::~HostWorker() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  posted_.notify_all();
  thread_.join();
}

void HostWorker::post(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  posted_.notify_one();
}

void HostWorker::wait() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [this] { return tasks_.empty() && !busy_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void set_host_threads(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads > 0 ? threads : std::max(1, omp_get_num_procs() - 2));
#else
  (void)threads;
#endif
}

void HostWorker::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    posted_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping, and nothing left
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    const bool skip = error_ != nullptr;  // a failed step: what follows it is not run
    busy_ = true;
    lock.unlock();
    std::exception_ptr failed;
    if (!skip) {
      try {
        task();
      } catch (...) {
        failed = std::current_exception();
      }
    }
    lock.lock();
    busy_ = false;
    if (failed && !error_) error_ = failed;
    if (tasks_.empty()) idle_.notify_all();
  }
}

}  // namespace gradkit::detail
