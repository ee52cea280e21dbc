// The NCCL communicator: GPU memory, collectives enqueued on the caller's
// stream. It is made in one of two ways:
// - from MPI: rank 0's unique id is broadcast over an MpiChannel, which the
//   communicator keeps for its host exchanges (checked mode's fingerprints,
//   Adasum's layout check, barrier); local ranks come from MPI;
// - from a unique id, a rank and a size that the caller hands every rank,
//   with no MPI at all: the host exchanges then go over NCCL itself (the
//   bytes staged through a small device buffer on an internal stream, one
//   ncclAllGather, and back), and local_rank / local_size come from the
//   ranks' host names, gathered that way right after NCCL has started.
// Either way the ranks start on a non-blocking NCCL communicator, so that
// start-up is bounded by the timeout. Then one of two ways:
// - blocking calls (CommunicatorOptions::blocking_calls): the ranks make a
//   blocking communicator from a new unique id, release the first, and
//   issue everything on the blocking one, in the caller's thread; a
//   watchdog thread (watchdog.h) keeps the timeout, ending the
//   communicator's work when a call or its work outlasts it or a peer fails;
// - non-blocking calls: every call is followed by polling
//   ncclCommGetAsyncError until NCCL's own thread has launched it.
// Every wait for a stream polls the stream and the watchdog (or the
// communicator), bounded by the timeout. A communicator that runs out of
// time or reports an error is aborted (ncclCommAbort) and throws.
//
// The class is declared here; its members are defined in
// nccl_communicator.cc (start-up, the collectives, waiting and failing),
// nccl_list_reduce.cc (list_all_reduce's split and pipelined paths and the
// fusion buffer's copies); nccl_create.cc makes it from a unique id,
// nccl_create_mpi.cc over MPI (create_nccl_communicator). Its NCCL calls go
// through the library loaded at first use (nccl_library.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "comm/host_channel.h"
#include "comm/layout_cache.h"
#include "spec/fusion_copy.h"
#include "comm/nccl/nccl_check.h"
#include "comm/nccl/split_plan.h"
#include "comm/nccl/watchdog.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/core/memory.h"

namespace gradkit::comm {

inline ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::f64: return ncclFloat64;
    case DType::u8:
    case DType::i16: break;  // refused by inspect_list
  }
  return ncclFloat32;
}

class NcclCommunicator final : public Communicator {
 public:
  // `channel`: the MPI path's MpiChannel (it gives the local layout); null
  // with a unique id (the local layout is then learnt in start()). Nothing
  // is made until start(), so that whatever start() has made when it fails
  // is released by the destructor.
  NcclCommunicator(int rank, int size, int local_rank, int local_size, int cuda_device,
                   const CommunicatorOptions& options, std::unique_ptr<comm::HostChannel> channel)
      : Communicator(rank, size, local_rank, local_size, Device::cuda(cuda_device), options),
        channel_(std::move(channel)),
        blocking_calls_(options.blocking_calls) {}

  // Joins the other ranks (every rank calls it with the same id). Without
  // MPI, then gathers the ranks' host names over NCCL: local_rank() is the
  // number of lower ranks with this rank's host name, local_size() the
  // number of ranks with it.
  void start(const ncclUniqueId& id);

  // options.blocking_calls: from here on a blocking communicator carries
  // everything, watched by a watchdog. (ncclCommSplit of the non-blocking
  // one cannot make it: NCCL refuses blocking and non-blocking communicators
  // in one group, and a split is one; NCCL 2.28.9 answered
  // ncclInternalError.) Rank 0's new unique id goes to every rank over the
  // host exchange, which is bounded by the timeout; the blocking init then
  // waits, unbounded, for ranks that have all just answered that exchange.
  // The non-blocking communicator, which has no work left, is released.
  void switch_to_blocking_calls();

  // Finalize flushes what is still queued; if that does not finish in time
  // the communicator is aborted rather than leaked in a hang.
  void release_non_blocking(ncclComm_t comm);

  // A healthy blocking communicator is finalized, not aborted: an abort
  // stops NCCL's proxy thread at once, and with a network transport the
  // bytes it still had to send for the last collective never reach the
  // peers, whose collective then fails or hangs. Finalizing waits for the
  // communicator's work, in the call; the watchdog bounds that wait (past
  // the timeout it aborts the communicator under the call).
  void release_blocking();

  ~NcclCommunicator() override;

  std::string_view backend_name() const override { return "nccl"; }

  void wait(Stream stream) override;

 protected:
  void do_all_reduce(const void* input, void* output, int64_t count, DType dtype, Stream stream) override;

  void do_all_gather(const void* input, void* output, int64_t count, DType dtype, Stream stream) override;

  void do_reduce_scatter(const void* input, void* output, int64_t count, DType dtype, Stream stream) override;

  void do_all_gathers(std::span<const BufferCall> calls, Stream stream) override;

  void do_reduce_scatters(std::span<const BufferCall> calls, Stream stream) override;

  void do_exchange(const void* send, void* receive, size_t bytes, int peer, Stream stream) override;

  void do_all_to_all(const void* send, const Sections& to, void* receive, const Sections& from,
                     Stream stream) override;
  void do_send(const void* data, size_t bytes, int peer, Stream stream) override;

  void do_receive(void* data, size_t bytes, int peer, Stream stream) override;

  void do_barrier() override;

  void host_all_gather(const void* input, void* output, size_t bytes) override;

  void copy(void* destination, const void* source, size_t bytes, Stream stream) override;

  void fill_zero(void* destination, size_t bytes, Stream stream) override;

  void divide(void* data, int64_t count, DType dtype, int divisor, Stream stream) override;

  // The fusion buffer may be used next on another stream: that stream first
  // waits for the end of the previous use.
  void fusion_begin(Stream stream) override;
  void fusion_end(Stream stream) override;

  size_t fusion_plans_built() const override { return copy_plans_.built() + split_plans_.built(); }

  // One multi-tensor kernel each way, from a plan cached per list.
  void pack(std::span<const TensorView> inputs, unsigned char* fusion, int64_t begin, int64_t end,
            Stream stream) override;
  void unpack(const unsigned char* fusion, std::span<const TensorView> outputs, int64_t begin, int64_t end,
              Stream stream) override;

  // Large tensors where they lie, small ones through the fusion buffer
  // (comm/nccl/split_plan.h); a list with no large tensor all through the
  // fusion buffer, in pieces, with no split planned. Both choices depend on
  // the element counts and the settings only, as every rank must issue the
  // same collectives: a list with a large tensor takes the split even when
  // it lies back to back (only its small tensors are then copied), and a
  // large back-to-back list goes in the same pieces, without copies.
  void list_all_reduce(const ListReduce& r, Stream stream) override;

 private:
  // NCCL accepts a bounded number of operations per group (2048 in its
  // documentation); larger lists take several groups.
  static constexpr size_t kMaxGroupOps = 1024;

  uint32_t list_settings() const override;

  // Pack the small tensors; one NCCL group with the fusion buffer's
  // collective and one per large tensor; divide everything for an average;
  // unpack the small tensors. All on the caller's stream.
  void split_all_reduce(const comm::SplitPlan& split, const ListReduce& r, Stream stream);

  // The result of NCCL calls that enqueue work, and which call it is from.
  struct Issued {
    ncclResult_t result;
    const char* call;
  };

  // Makes the NCCL calls that enqueue work on `stream` (`calls()` returns
  // the first failure, or the last call's result; `what` names them all)
  // and deals with the outcome. Non-blocking: polls until NCCL has launched them (settle).
  // Blocking: refused at once if the watchdog has revoked the communicator;
  // the watchdog bounds the time inside the calls, then the work they
  // enqueued. Any failure aborts the communicator and throws.
  template <class Calls>
  void issue_all(const char* what, cudaStream_t stream, Calls&& calls) {
    if (!watchdog_) {
      const Issued done = calls();
      settle(done.result, done.call, __FILE__, __LINE__);
      return;
    }
    Issued done{ncclSuccess, nullptr};
    bool refused = false;
    std::string detail;
    {
      const comm::NcclWatchdog::InCall inside(*watchdog_, what);
      refused = watchdog_->fired();  // then the communicator may be gone
      if (!refused) {
        done = calls();
        if (done.result != ncclSuccess) detail = nccl().ncclGetLastError(comm_);
      }
    }
    // (abort_and_throw reports the watchdog's cause where it fired.)
    if (refused) abort_and_throw(ncclInvalidUsage, what, "refused");
    if (done.result != ncclSuccess) abort_and_throw(done.result, done.call, detail);
    watchdog_->watch(stream, what);
  }

  // One NCCL call named `call`, made by make_call(), on `stream`.
  template <class Call>
  void issue(const char* call, cudaStream_t stream, Call&& make_call) {
    issue_all(call, stream, [&] { return Issued{make_call(), call}; });
  }

  // Runs body(add) between ncclGroupStart and ncclGroupEnd, where body
  // calls add(result, name) with each enqueued call's result. The group is
  // closed whatever happened inside it; the first failure, or the group's
  // end, is the outcome.
  template <class Body>
  void grouped(const char* what, cudaStream_t stream, Body&& body) {
    issue_all(what, stream, [&] {
      GRADKIT_NCCL_CHECK(nccl().ncclGroupStart());
      Issued failed{ncclSuccess, nullptr};
      body([&](ncclResult_t result, const char* call) {
        if (result != ncclSuccess && result != ncclInProgress && failed.result == ncclSuccess) failed = {result, call};
      });
      const ncclResult_t ended = nccl().ncclGroupEnd();
      return failed.result != ncclSuccess ? failed : Issued{ended, "ncclGroupEnd"};
    });
  }

  // Operations 0 .. count - 1, each added by add_one(k, add), in as few
  // groups as NCCL allows (kMaxGroupOps each).
  template <class AddOne>
  void grouped_in_batches(const char* what, size_t count, cudaStream_t stream, AddOne&& add_one) {
    for (size_t first = 0; first < count; first += kMaxGroupOps) {
      const size_t last = std::min(count, first + kMaxGroupOps);
      grouped(what, stream, [&](auto&& add) {
        for (size_t k = first; k < last; ++k) add_one(k, add);
      });
    }
  }

  // A list with no large tensor goes in pieces through three streams: pack
  // (piece i into the fusion buffer), reduce (the collective and the
  // average's division on piece i once it is packed; the highest priority,
  // so that NCCL's blocks are scheduled before waiting copy blocks) and
  // unpack (piece i back once it is reduced). Pieces are disjoint ranges of
  // the concatenation, so no copy of one piece touches what another stage
  // works on. The caller's stream forks into the three and joins them at the
  // end.
  void pipelined_all_reduce(const ListReduce& r, Stream stream);

  // Returns once the work enqueued on `stream` has finished. Meanwhile polls
  // the communicator: a failed peer or network, or the timeout, aborts it
  // and throws naming `op` (wait() and the host exchanges over NCCL).
  void await(cudaStream_t stream, const char* op);

  // The host all-gather of a communicator without MPI: this rank's `bytes`
  // go through pinned host memory into its slot of a device buffer, on an
  // internal stream; one in-place ncclAllGather; the whole buffer back into
  // pinned memory, and await() (so the timeout and the abort hold, and no
  // copy to pageable memory can block the host). NCCL runs a communicator's
  // operations in the order they were issued, so this also waits for the
  // collectives enqueued before it on other streams (no caller relies on
  // that order).
  void gather_through_nccl(const void* input, void* output, size_t bytes, const char* op);

  // The staging buffers of gather_through_nccl, at least `bytes` long
  // (grow-only). Only the second exchange of a checked-mode size mismatch
  // on a list of thousands of tensors outgrows what start() makes.
  void reserve_exchange(size_t bytes);

  // A non-blocking communicator may answer ncclInProgress: the call is
  // still being set up, and nothing else may be issued until it has
  // settled. Polls until it has, within the timeout; aborts on failure.
  void settle(ncclResult_t result, const char* call, const char* file, int line);

  // With blocking calls, a failure that the watchdog caused (a call that it
  // interrupted, or refused after revoking) is reported by its cause.
  [[noreturn]] void abort_and_throw(ncclResult_t status, const char* call, std::string detail,
                                    const char* file = __FILE__, int line = __LINE__);

  template <class Fn>
  void guarded(Fn&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      mark_unusable(e.what());
      throw;
    }
  }

  struct FreePinned {
    void operator()(unsigned char* p) const { cudaFreeHost(p); }
  };

  std::unique_ptr<comm::HostChannel> channel_;  // null: made from a unique id
  // Non-blocking until start() has joined the ranks; then, with
  // blocking_calls_, the blocking communicator that replaced it, watched
  // by watchdog_.
  ncclComm_t comm_ = nullptr;
  bool blocking_calls_ = false;
  std::unique_ptr<comm::NcclWatchdog> watchdog_;
  cudaEvent_t fusion_free_ = nullptr;
  // The host exchanges over NCCL (no channel_): a stream, and the staging
  // buffers on the device and in pinned host memory, made in start().
  cudaStream_t exchange_stream_ = nullptr;
  Buffer exchange_device_;
  std::unique_ptr<unsigned char, FreePinned> exchange_host_;

  // The streams and events of the pipelined fusion path, made on first use.
  void create_pipeline();

  std::shared_ptr<const comm::FusionCopyPlan> copy_plan(std::span<const TensorView> tensors, unsigned char* fusion,
                                                        DType dtype);

  comm::LayoutCache<comm::FusionCopyPlan> copy_plans_{comm::kLayoutsKept};
  comm::LayoutCache<comm::SplitPlan> split_plans_{comm::kLayoutsKept};
  cudaStream_t pack_stream_ = nullptr, reduce_stream_ = nullptr, unpack_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, packed_ = nullptr, reduced_ = nullptr, reduce_done_ = nullptr,
              unpack_done_ = nullptr;
};

}  // namespace gradkit::comm
