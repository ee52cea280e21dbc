#include "comm/nccl/watchdog.h"

#include <algorithm>

#include "comm/nccl/nccl_library.h"
#include "cuda/check.h"

namespace gradkit::comm {

namespace {

using Clock = std::chrono::steady_clock;

// A tenth of the timeout, so that the watchdog acts at most 10% late; at most
// 20 ms (a look costs a few microseconds of a thread that otherwise sleeps)
// and at least 1 ms.
std::chrono::milliseconds period_for(std::chrono::milliseconds timeout) {
  return std::clamp(timeout / 10, std::chrono::milliseconds(1), std::chrono::milliseconds(20));
}

std::string ms(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

}  // namespace

NcclWatchdog::NcclWatchdog(ncclComm_t comm, int cuda_device, std::chrono::milliseconds timeout)
    : comm_(comm), device_(cuda_device), timeout_(timeout), period_(period_for(timeout)) {
  thread_ = std::thread([this] { run(); });
}

NcclWatchdog::~NcclWatchdog() {
  stop();
  // An event still recorded on a stream is released once its work is done.
  for (const Pending& p : pending_) cudaEventDestroy(p.event);
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

NcclWatchdog::InCall::InCall(NcclWatchdog& watchdog, const char* call) : watchdog_(watchdog) {
  watchdog_.call_mutex_.lock();
  watchdog_.call_.store(call, std::memory_order_relaxed);
  watchdog_.call_since_.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
}

NcclWatchdog::InCall::~InCall() {
  watchdog_.call_since_.store(0, std::memory_order_release);
  watchdog_.call_mutex_.unlock();
}

void NcclWatchdog::watch(cudaStream_t stream, const char* call) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  GRADKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  cudaEvent_t event = nullptr;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      event = free_.back();
      free_.pop_back();
    }
  }
  if (event == nullptr) GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, stream);
  const std::lock_guard<std::mutex> lock(mutex_);
  if (recorded != cudaSuccess) {
    free_.push_back(event);
    cuda::throw_cuda_error(recorded, "cudaEventRecord", __FILE__, __LINE__);
  }
  pending_.push_back({event, Clock::now() + timeout_, call});
}

std::string NcclWatchdog::reason() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return reason_;
}

ncclResult_t NcclWatchdog::status() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return status_;
}

void NcclWatchdog::stop() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) return;
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void NcclWatchdog::run() {
  // The events and the revoke belong to this rank's GPU. Relaxed capture
  // mode: the owner may be capturing a CUDA graph in global mode, which
  // would otherwise forbid this thread's event queries (and a forbidden
  // call would invalidate the owner's capture).
  cudaSetDevice(device_);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  std::vector<Pending> work;
  std::vector<cudaEvent_t> finished;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, period_);
    if (stopping_) break;
    // Look without the lock, so that the owner's watch() never waits for
    // the event queries.
    work.swap(pending_);
    lock.unlock();
    ncclResult_t status = ncclSuccess;
    bool stuck = false;
    const std::string why = look(work, finished, status, stuck);
    lock.lock();
    pending_.insert(pending_.end(), work.begin(), work.end());
    free_.insert(free_.end(), finished.begin(), finished.end());
    work.clear();
    finished.clear();
    if (!why.empty()) {
      lock.unlock();
      fire(why, status, stuck);
      return;
    }
  }
}

std::string NcclWatchdog::look(std::vector<Pending>& work, std::vector<cudaEvent_t>& finished,
                               ncclResult_t& status, bool& stuck) {
  ncclResult_t async = ncclSuccess;
  if (nccl().ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
    status = async;
    return "a peer or the network failed (NCCL reports it asynchronously)";
  }
  const Clock::time_point now = Clock::now();
  const int64_t since = call_since_.load(std::memory_order_acquire);
  if (since != 0 && now - Clock::time_point(Clock::duration(since)) > timeout_) {
    status = ncclInProgress;
    stuck = true;
    return std::string(call_.load(std::memory_order_relaxed)) + " did not return within " + ms(timeout_) +
           ": another rank has not joined it (it died, hangs, or makes a different call)";
  }
  std::string why;
  auto still = work.begin();
  for (const Pending& p : work) {
    const cudaError_t done = cudaEventQuery(p.event);
    if (done == cudaSuccess) {
      finished.push_back(p.event);
      continue;
    }
    *still++ = p;
    if (!why.empty()) continue;
    if (done != cudaErrorNotReady) {
      status = ncclUnhandledCudaError;
      why = std::string("the work of ") + p.call + " failed on the device: " + cudaGetErrorName(done) + " (" +
            cudaGetErrorString(done) + ")";
    } else if (now > p.deadline) {
      status = ncclInProgress;
      why = std::string("the work of ") + p.call + " did not finish within " + ms(timeout_) +
            " of its enqueue: another rank has not joined it (it died, hangs, or makes a different call)";
    }
  }
  work.erase(still, work.end());
  return why;
}

void NcclWatchdog::fire(const std::string& why, ncclResult_t status, bool stuck) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    reason_ = why;
    status_ = status;
  }
  fired_.store(true);  // sequentially consistent with finalizing(): one of the two sees the other
  ncclResult_t ended = ncclSuccess;
  const char* how = "ncclCommRevoke";
  const auto revoke = finalizing_.load() ? nullptr : nccl().ncclCommRevoke;
  if (revoke != nullptr) {
    ended = revoke(comm_, 0);  // NCCL_REVOKE_DEFAULT
  } else {
    how = "ncclCommAbort";
    // Out of NCCL, the owner checks fired() before its next call; a call
    // in progress may still end by itself. Stuck in a call: no waiting.
    std::unique_lock<std::timed_mutex> owner(call_mutex_, std::defer_lock);
    if (!stuck && !owner.try_lock_for(timeout_ + period_)) {
      const std::lock_guard<std::mutex> lock(mutex_);
      reason_ += " (the owner's call did not return either: aborted under it)";
    }
    ended = nccl().ncclCommAbort(comm_);
    aborted_ = true;
  }
  if (ended != ncclSuccess) {
    const std::lock_guard<std::mutex> lock(mutex_);
    reason_ += std::string(" (") + how + " answered " + nccl().ncclGetErrorString(ended) + ")";
  }
}

}  // namespace gradkit::comm
