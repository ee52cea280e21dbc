// The timeout of a blocking NCCL communicator (CommunicatorOptions::
// blocking_calls), kept by a thread of its own rather than by polling in
// every call.
//
// A blocking communicator enqueues in the caller's thread, at the raw NCCL
// call's host cost, where a non-blocking one hands every call to a new
// thread that the caller then polls (NCCL 2.28, ncclGroupEndInternal). But a
// blocking call can block: the first use of a connection waits for the peer,
// a full work queue waits for the device; and the kernels it enqueued wait
// on the device for a peer that may have died. The watchdog bounds all of
// it. Every `period` it looks at
// - the call the owner's thread is inside (InCall), if any: inside for
//   longer than the timeout;
// - the work enqueued (watch(): an event recorded after each call): not
//   finished within the timeout of its enqueue;
// - NCCL's asynchronous error (a peer or the network failed);
// and on the first of these ends the communicator's work:
// - where the NCCL library loaded has ncclCommRevoke (2.28.7 and later,
//   looked up when NCCL is loaded: nccl_library.h), it revokes the communicator: NCCL's abort flags end
//   every wait in NCCL's host code and kernels and later calls are
//   refused, but nothing is freed under a thread that may still be inside
//   NCCL; the owner aborts it afterwards, on its own thread;
// - otherwise it aborts the communicator itself (ncclCommAbort), once the
//   owner's thread is out of NCCL (InCall holds a lock that the abort
//   takes), or, when that thread is stuck inside a call past the timeout,
//   at once, under it: the race PyTorch's watchdog also runs with older
//   NCCL, taken rather than a hang.
// The owner sees fired(), calls stop() (which returns once the revoke or
// abort has ended), aborts the communicator unless aborted(), and throws
// reason(). PyTorch's process groups keep their timeouts the same way, with
// a watchdog over blocking communicators.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace gradkit::comm {

class NcclWatchdog {
 public:
  // Starts the thread. `comm` must outlive it (until stop() has returned).
  NcclWatchdog(ncclComm_t comm, int cuda_device, std::chrono::milliseconds timeout);
  ~NcclWatchdog();
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;

  // The owner's thread may call NCCL on the communicator while this lives
  // (one at a time: a communicator has one caller at a time); `call` names
  // the call. Check fired() first: once it is true, the communicator may be
  // gone.
  class InCall {
   public:
    InCall(NcclWatchdog& watchdog, const char* call);
    ~InCall();
    InCall(const InCall&) = delete;
    InCall& operator=(const InCall&) = delete;

   private:
    NcclWatchdog& watchdog_;
  };

  // The work `call` just enqueued on `stream` must finish within the
  // timeout. Not watched while `stream` is being captured into a CUDA
  // graph: that work runs when the graph is launched.
  void watch(cudaStream_t stream, const char* call);

  // The owner is about to finalize the communicator (inside an InCall):
  // from now on the watchdog aborts rather than revokes (NCCL refuses to
  // revoke a communicator being finalized).
  void finalizing() { finalizing_.store(true); }

  // Whether the watchdog has revoked or aborted the communicator (or is
  // doing so).
  bool fired() const { return fired_.load(); }
  // Whether it aborted the communicator itself (no ncclCommRevoke): then
  // the owner must not touch it again. Meaningful after stop().
  bool aborted() const { return aborted_; }
  // Why, and the NCCL status that stands for it (ncclInProgress for a
  // timeout); meaningful once fired().
  std::string reason() const;
  ncclResult_t status() const;

  // Ends the thread, after a revoke in progress has ended; afterwards the
  // watchdog touches the communicator no more. Idempotent.
  void stop();

 private:
  struct Pending {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point deadline;
    const char* call;
  };

  void run();
  // Empty while all is well; otherwise why the communicator must go.
  // Moves the finished entries of `work` into `finished`.
  // `stuck`: the owner's thread has been inside a call past the timeout.
  std::string look(std::vector<Pending>& work, std::vector<cudaEvent_t>& finished, ncclResult_t& status,
                   bool& stuck);
  void fire(const std::string& why, ncclResult_t status, bool stuck);

  const ncclComm_t comm_;
  const int device_;
  const std::chrono::milliseconds timeout_;
  const std::chrono::milliseconds period_;

  // InCall: the steady_clock tick count at entry (0: no call) and its name.
  std::atomic<int64_t> call_since_{0};
  std::atomic<const char*> call_{nullptr};
  std::atomic<bool> fired_{false};
  std::atomic<bool> finalizing_{false};
  bool aborted_ = false;  // written by the thread, read after it is joined
  // Held by InCall; the abort without ncclCommRevoke takes it, so that it
  // waits for the owner's call to end (up to a period past the timeout).
  std::timed_mutex call_mutex_;

  mutable std::mutex mutex_;  // everything below
  std::condition_variable wake_;
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> free_;  // events whose work has finished, for reuse
  bool stopping_ = false;
  std::string reason_;
  ncclResult_t status_ = ncclSuccess;
  std::thread thread_;
};

}  // namespace gradkit::comm
