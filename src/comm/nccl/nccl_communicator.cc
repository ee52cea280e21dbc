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
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/cuda_runtime.h"
#include "comm/mpi/mpi_channel.h"
#include "comm/nccl/divide.h"
#include "comm/nccl/fusion_copy.h"
#include "comm/layout_cache.h"
#include "comm/nccl/nccl_check.h"
#include "comm/nccl/split_plan.h"
#include "comm/nccl/watchdog.h"
#include "cuda/check.h"

namespace gradkit {

namespace {

ncclDataType_t nccl_type(DType dtype) {
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

static_assert(sizeof(ncclUniqueId) == 128 && sizeof(NcclUniqueId::bytes) == sizeof(ncclUniqueId),
              "NcclUniqueId holds an ncclUniqueId byte for byte");

class NcclCommunicator final : public Communicator {
 public:
  // `channel`: the MPI path's (it gives the local layout); null with a unique
  // id (the local layout is then learnt in start()). Nothing is made until
  // start(), so that whatever start() has made when it fails is released by
  // the destructor.
  NcclCommunicator(int rank, int size, int local_rank, int local_size, int cuda_device,
                   const CommunicatorOptions& options, std::unique_ptr<comm::MpiChannel> channel)
      : Communicator(rank, size, local_rank, local_size, Device::cuda(cuda_device), options),
        channel_(std::move(channel)),
        blocking_calls_(options.blocking_calls) {}

  // Joins the other ranks (every rank calls it with the same id). Without
  // MPI, then gathers the ranks' host names over NCCL: local_rank() is the
  // number of lower ranks with this rank's host name, local_size() the
  // number of ranks with it.
  void start(const ncclUniqueId& id) {
    cuda::DeviceGuard guard(device().index);
    GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&fusion_free_, cudaEventDisableTiming));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; settle() polls with the timeout
    settle(ncclCommInitRankConfig(&comm_, size(), id, rank(), &config), "ncclCommInitRankConfig", __FILE__,
           __LINE__);
    if (channel_) {
      if (blocking_calls_) switch_to_blocking_calls();
      return;
    }
    // The host exchanges' stream and staging buffers, made now rather than
    // on first use, when growing them (which frees the old ones and waits
    // for the device) could wait for a collective that never ends: large
    // enough for the host names, fingerprints, barriers and Adasum's layout
    // check.
    GRADKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&exchange_stream_, cudaStreamNonBlocking));
    reserve_exchange(std::max(size_t{64} << 10, size_t{256} * static_cast<size_t>(size())));
    using HostName = std::array<char, 256>;  // Linux allows 64 characters
    HostName mine{};
    if (gethostname(mine.data(), mine.size() - 1) != 0) {
      throw Error(ErrorCode::backend_unavailable,
                  "create_nccl_communicator: gethostname failed (" + std::string(std::strerror(errno)) +
                      "): the local rank cannot be found");
    }
    std::vector<HostName> all(static_cast<size_t>(size()));
    gather_through_nccl(mine.data(), all.data(), sizeof(HostName), "create_nccl_communicator (host names)");
    int local_rank = 0, local_size = 0;
    for (int r = 0; r < size(); ++r) {
      if (all[static_cast<size_t>(r)] != mine) continue;
      if (r < rank()) ++local_rank;
      ++local_size;
    }
    set_local_layout(local_rank, local_size);
    if (blocking_calls_) switch_to_blocking_calls();
  }

  // options.blocking_calls: from here on a blocking communicator carries
  // everything, watched by a watchdog. (ncclCommSplit of the non-blocking
  // one cannot make it: NCCL refuses blocking and non-blocking communicators
  // in one group, and a split is one; NCCL 2.28.9 answered
  // ncclInternalError.) Rank 0's new unique id goes to every rank over the
  // host exchange, which is bounded by the timeout; the blocking init then
  // waits, unbounded, for ranks that have all just answered that exchange.
  // The non-blocking communicator, which has no work left, is released.
  void switch_to_blocking_calls() {
    ncclUniqueId id{};
    if (rank() == 0) GRADKIT_NCCL_CHECK(ncclGetUniqueId(&id));
    std::vector<ncclUniqueId> all(static_cast<size_t>(size()));
    host_all_gather(&id, all.data(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclComm_t blocking = nullptr;
    const ncclResult_t made = ncclCommInitRankConfig(&blocking, size(), all[0], rank(), &config);
    if (made != ncclSuccess) {
      // Nothing to abort of the blocking one: a failed init leaves no communicator.
      abort_and_throw(made, "ncclCommInitRankConfig (blocking calls)", ncclGetLastError(nullptr));
    }
    release_non_blocking(std::exchange(comm_, blocking));
    watchdog_ = std::make_unique<comm::NcclWatchdog>(comm_, device().index, timeout());
  }

  // Finalize flushes what is still queued; if that does not finish in time
  // the communicator is aborted rather than leaked in a hang.
  void release_non_blocking(ncclComm_t comm) {
    ncclResult_t state = ncclCommFinalize(comm);
    const auto start = std::chrono::steady_clock::now();
    while (state == ncclInProgress && std::chrono::steady_clock::now() - start < timeout()) {
      std::this_thread::yield();
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess) ncclCommDestroy(comm);
    else ncclCommAbort(comm);
  }

  // A healthy blocking communicator is finalized, not aborted: an abort
  // stops NCCL's proxy thread at once, and with a network transport the
  // bytes it still had to send for the last collective never reach the
  // peers, whose collective then fails or hangs. Finalizing waits for the
  // communicator's work, in the call; the watchdog bounds that wait (past
  // the timeout it aborts the communicator under the call).
  void release_blocking() {
    ncclResult_t finalized = ncclInternalError;
    {
      const comm::NcclWatchdog::InCall inside(*watchdog_, "ncclCommFinalize");
      watchdog_->finalizing();  // first: a watchdog that fires from here on aborts, after this call
      if (!watchdog_->fired()) finalized = ncclCommFinalize(comm_);
    }
    watchdog_->stop();
    if (watchdog_->aborted()) return;
    if (finalized == ncclSuccess) ncclCommDestroy(comm_);
    else ncclCommAbort(comm_);
  }

  ~NcclCommunicator() override {
    try {
      cuda::DeviceGuard guard(device().index);
      if (comm_ != nullptr) {
        if (watchdog_) release_blocking();
        else release_non_blocking(comm_);
      }
      watchdog_.reset();
      if (fusion_free_ != nullptr) cudaEventDestroy(fusion_free_);
      for (cudaEvent_t e : {fork_, packed_, reduced_, reduce_done_, unpack_done_}) {
        if (e != nullptr) cudaEventDestroy(e);
      }
      for (cudaStream_t s : {pack_stream_, reduce_stream_, unpack_stream_, exchange_stream_}) {
        if (s != nullptr) cudaStreamDestroy(s);
      }
    } catch (...) {
      // A destructor must not throw; the device is gone or unusable anyway.
    }
  }

  std::string_view backend_name() const override { return "nccl"; }

  void wait(Stream stream) override {
    require_usable("wait");
    cuda::DeviceGuard guard(device().index);
    await(cuda::native(stream), "wait");
  }

 protected:
  void do_all_reduce(const void* input, void* output, int64_t count, DType dtype, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    issue("ncclAllReduce", s, [&] {
      return ncclAllReduce(input, output, static_cast<size_t>(count), nccl_type(dtype), ncclSum, comm_, s);
    });
  }

  void do_all_gather(const void* input, void* output, int64_t count, DType dtype, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    issue("ncclAllGather", s,
          [&] { return ncclAllGather(input, output, static_cast<size_t>(count), nccl_type(dtype), comm_, s); });
  }

  void do_reduce_scatter(const void* input, void* output, int64_t count, DType dtype, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    issue("ncclReduceScatter", s, [&] {
      return ncclReduceScatter(input, output, static_cast<size_t>(count), nccl_type(dtype), ncclSum, comm_, s);
    });
  }

  void do_all_gathers(std::span<const BufferCall> calls, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    grouped_in_batches("a group of ncclAllGather", calls.size(), s, [&](size_t k, auto&& add) {
      const BufferCall& c = calls[k];
      add(ncclAllGather(c.input, c.output, static_cast<size_t>(c.count_per_rank), nccl_type(c.dtype), comm_, s),
          "ncclAllGather");
    });
  }

  void do_reduce_scatters(std::span<const BufferCall> calls, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    grouped_in_batches("a group of ncclReduceScatter", calls.size(), s, [&](size_t k, auto&& add) {
      const BufferCall& c = calls[k];
      add(ncclReduceScatter(c.input, c.output, static_cast<size_t>(c.count_per_rank), nccl_type(c.dtype), ncclSum,
                            comm_, s),
          "ncclReduceScatter");
    });
  }

  void do_exchange(const void* send, void* receive, size_t bytes, int peer, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    grouped("ncclSend and ncclRecv", s, [&](auto&& add) {
      add(ncclSend(send, bytes, ncclUint8, peer, comm_, s), "ncclSend");
      add(ncclRecv(receive, bytes, ncclUint8, peer, comm_, s), "ncclRecv");
    });
  }

  void do_send(const void* data, size_t bytes, int peer, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    issue("ncclSend", s, [&] { return ncclSend(data, bytes, ncclUint8, peer, comm_, s); });
  }

  void do_receive(void* data, size_t bytes, int peer, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    issue("ncclRecv", s, [&] { return ncclRecv(data, bytes, ncclUint8, peer, comm_, s); });
  }

  void do_barrier() override {
    if (channel_) {
      guarded([&] { channel_->barrier(); });
      return;
    }
    const unsigned char mine = 1;
    std::vector<unsigned char> all(static_cast<size_t>(size()));
    gather_through_nccl(&mine, all.data(), 1, "barrier");
  }

  void host_all_gather(const void* input, void* output, size_t bytes) override {
    if (channel_) {
      guarded([&] { channel_->all_gather_bytes(input, output, bytes); });
      return;
    }
    gather_through_nccl(input, output, bytes, "host_all_gather");
  }

  void copy(void* destination, const void* source, size_t bytes, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    GRADKIT_CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, cuda::native(stream)));
  }

  void fill_zero(void* destination, size_t bytes, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    GRADKIT_CUDA_CHECK(cudaMemsetAsync(destination, 0, bytes, cuda::native(stream)));
  }

  void divide(void* data, int64_t count, DType dtype, int divisor, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    comm::divide_on_device(data, count, dtype, divisor, cuda::native(stream));
  }

  // The fusion buffer may be used next on another stream: that stream first
  // waits for the end of the previous use.
  void fusion_begin(Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(cuda::native(stream), fusion_free_, 0));
  }
  void fusion_end(Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    GRADKIT_CUDA_CHECK(cudaEventRecord(fusion_free_, cuda::native(stream)));
  }

  size_t fusion_plans_built() const override { return copy_plans_.built() + split_plans_.built(); }

  // One multi-tensor kernel each way, from a plan cached per list.
  void pack(std::span<const TensorView> inputs, unsigned char* fusion, int64_t begin, int64_t end,
            Stream stream) override {
    if (begin >= end) return;
    copy_plan(inputs, fusion, inputs[0].dtype)->copy(begin, end, /*to_fusion=*/true, cuda::native(stream));
  }
  void unpack(const unsigned char* fusion, std::span<const TensorView> outputs, int64_t begin, int64_t end,
              Stream stream) override {
    if (begin >= end) return;
    copy_plan(outputs, const_cast<unsigned char*>(fusion), outputs[0].dtype)
        ->copy(begin, end, /*to_fusion=*/false, cuda::native(stream));
  }

  // Large tensors where they lie, small ones through the fusion buffer
  // (comm/nccl/split_plan.h); a list with no large tensor all through the
  // fusion buffer, in pieces, with no split planned. Both choices depend on
  // the element counts and the settings only, as every rank must issue the
  // same collectives: a list with a large tensor takes the split even when
  // it lies back to back (only its small tensors are then copied), and a
  // large back-to-back list goes in the same pieces, without copies.
  void list_all_reduce(const ListReduce& r, Stream stream) override {
    const size_t threshold = direct_tensor_bytes();
    const auto large = [&](const TensorView& t) { return comm::SplitPlan::goes_direct(t, threshold); };
    if (std::any_of(r.inputs.begin(), r.inputs.end(), large)) {
      const std::shared_ptr<const comm::SplitPlan> split = split_plans_.get(
          {r.inputs, r.outputs},
          {reinterpret_cast<uintptr_t>(r.source), reinterpret_cast<uintptr_t>(r.destination),
           static_cast<uint64_t>(r.dtype), threshold},
          [&] {
            return std::make_shared<const comm::SplitPlan>(r.inputs, r.outputs, r.source, r.destination, r.dtype,
                                                           threshold);
          });
      split_all_reduce(*split, r, stream);
      return;
    }
    pipelined_all_reduce(r, stream);
  }

 private:
  // NCCL accepts a bounded number of operations per group (2048 in its
  // documentation); larger lists take several groups.
  static constexpr size_t kMaxGroupOps = 1024;

  uint32_t list_settings() const override {
    // FNV-1a over the two settings that shape list_all_reduce's collectives.
    uint32_t hash = 2166136261u;
    for (uint64_t v : {static_cast<uint64_t>(direct_tensor_bytes()), static_cast<uint64_t>(fusion_pipeline_bytes())}) {
      for (int byte = 0; byte < 8; ++byte, v >>= 8) hash = (hash ^ static_cast<uint32_t>(v & 0xff)) * 16777619u;
    }
    return hash;
  }

  // Pack the small tensors; one NCCL group with the fusion buffer's
  // collective and one per large tensor; divide everything for an average;
  // unpack the small tensors. All on the caller's stream.
  void split_all_reduce(const comm::SplitPlan& split, const ListReduce& r, Stream stream) {
    cuda::DeviceGuard guard(device().index);
    const cudaStream_t s = cuda::native(stream);
    const int64_t packed = split.packed_total();
    unsigned char* fusion = nullptr;
    if (packed > 0) {
      fusion = fusion_bytes(static_cast<size_t>(packed) * dtype_size(r.dtype));
      fusion_begin(stream);
      copy_plan(split.packed_inputs(), fusion, r.dtype)->copy(0, packed, /*to_fusion=*/true, s);
    }
    // Operation k: the fusion buffer's collective first (when there is one),
    // then the direct tensors in list order.
    const std::span<const comm::SplitPlan::Direct> direct = split.direct();
    const size_t first_direct = packed > 0 ? 1 : 0;
    const size_t operations = first_direct + direct.size();
    const ncclDataType_t type = nccl_type(r.dtype);
    grouped_in_batches("a group of ncclAllReduce", operations, s, [&](size_t k, auto&& add) {
      if (k < first_direct) {
        add(ncclAllReduce(fusion, fusion, static_cast<size_t>(packed), type, ncclSum, comm_, s), "ncclAllReduce");
        return;
      }
      const comm::SplitPlan::Direct& d = direct[k - first_direct];
      add(ncclAllReduce(d.input, d.output, static_cast<size_t>(d.count), type, ncclSum, comm_, s), "ncclAllReduce");
    });
    if (packed > 0) {
      copy_plan(split.packed_outputs(), fusion, r.dtype)->copy(0, packed, /*to_fusion=*/false, s);
      fusion_end(stream);
    }
    if (r.reduce == ReduceOp::average) comm::divide_on_device(split.divide_plan(), size(), s);
  }

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
        if (done.result != ncclSuccess) detail = ncclGetLastError(comm_);
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
      GRADKIT_NCCL_CHECK(ncclGroupStart());
      Issued failed{ncclSuccess, nullptr};
      body([&](ncclResult_t result, const char* call) {
        if (result != ncclSuccess && result != ncclInProgress && failed.result == ncclSuccess) failed = {result, call};
      });
      const ncclResult_t ended = ncclGroupEnd();
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
  void pipelined_all_reduce(const ListReduce& r, Stream stream) {
    const size_t element = dtype_size(r.dtype);
    const size_t piece_bytes = fusion_pipeline_bytes();
    if (piece_bytes == 0 || static_cast<size_t>(r.total) * element <= 2 * piece_bytes) {
      Communicator::list_all_reduce(r, stream);
      return;
    }
    // Pieces of equal size (the last one shorter) starting on 256-byte
    // boundaries of the fusion buffer.
    const auto unit = static_cast<int64_t>(256 / element);
    const auto pieces = static_cast<int64_t>((static_cast<size_t>(r.total) * element + piece_bytes - 1) / piece_bytes);
    const int64_t piece = ((r.total + pieces - 1) / pieces + unit - 1) / unit * unit;

    cuda::DeviceGuard guard(device().index);
    create_pipeline();
    // A back-to-back list goes in the same pieces with no fusion buffer.
    const bool uses_fusion = r.source == nullptr || r.destination == nullptr;
    unsigned char* fusion = uses_fusion ? fusion_bytes(static_cast<size_t>(r.total) * element) : nullptr;
    std::shared_ptr<const comm::FusionCopyPlan> in_plan, out_plan;
    if (r.source == nullptr) in_plan = copy_plan(r.inputs, fusion, r.dtype);
    if (r.destination == nullptr) out_plan = copy_plan(r.outputs, fusion, r.dtype);

    const cudaStream_t caller = cuda::native(stream);
    if (uses_fusion) fusion_begin(stream);  // before the fork: the three streams inherit the wait
    GRADKIT_CUDA_CHECK(cudaEventRecord(fork_, caller));
    for (cudaStream_t s : {pack_stream_, reduce_stream_, unpack_stream_}) {
      GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(s, fork_, 0));
    }
    // An event is re-recorded for each piece: every wait is enqueued right
    // after the record it must see, which is the one it waits for.
    for (int64_t begin = 0; begin < r.total; begin += piece) {
      const int64_t end = std::min(r.total, begin + piece);
      const size_t at = static_cast<size_t>(begin) * element;
      if (in_plan) {
        in_plan->copy(begin, end, /*to_fusion=*/true, pack_stream_);
        GRADKIT_CUDA_CHECK(cudaEventRecord(packed_, pack_stream_));
        GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(reduce_stream_, packed_, 0));
      }
      const unsigned char* source = (r.source != nullptr ? r.source : fusion) + at;
      unsigned char* destination = (r.destination != nullptr ? r.destination : fusion) + at;
      do_all_reduce(source, destination, end - begin, r.dtype, Stream{reduce_stream_});
      if (r.reduce == ReduceOp::average) divide(destination, end - begin, r.dtype, size(), Stream{reduce_stream_});
      if (out_plan) {
        GRADKIT_CUDA_CHECK(cudaEventRecord(reduced_, reduce_stream_));
        GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(unpack_stream_, reduced_, 0));
        out_plan->copy(begin, end, /*to_fusion=*/false, unpack_stream_);
      }
    }
    // Every pack precedes a collective on the reduce stream, so joining the
    // reduce and unpack streams joins all three.
    GRADKIT_CUDA_CHECK(cudaEventRecord(reduce_done_, reduce_stream_));
    GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(caller, reduce_done_, 0));
    GRADKIT_CUDA_CHECK(cudaEventRecord(unpack_done_, unpack_stream_));
    GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(caller, unpack_done_, 0));
    if (uses_fusion) fusion_end(stream);
  }

  // Returns once the work enqueued on `stream` has finished. Meanwhile polls
  // the communicator: a failed peer or network, or the timeout, aborts it
  // and throws naming `op` (wait() and the host exchanges over NCCL).
  void await(cudaStream_t stream, const char* op) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t done = cudaStreamQuery(stream);
      // The watchdog marks itself fired before it ends the communicator's
      // work: work that ended that way (without its result) is caught here.
      // It also watches NCCL's asynchronous errors: with it, this thread
      // leaves the communicator alone.
      if (watchdog_ && watchdog_->fired()) abort_and_throw(watchdog_->status(), op, watchdog_->reason());
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady) GRADKIT_CUDA_CHECK(done);
      ncclResult_t state = ncclSuccess;
      if (!watchdog_) GRADKIT_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state != ncclSuccess && state != ncclInProgress) {
        abort_and_throw(state, op, "a peer or the network failed while the stream's collectives ran");
      }
      if (std::chrono::steady_clock::now() - start > timeout()) {
        abort_and_throw(ncclInProgress, op,
                        "the stream's collectives did not finish within " + std::to_string(timeout().count()) +
                            " ms: another rank has not joined (it died, hangs, or makes a different call)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // The host all-gather of a communicator without MPI: this rank's `bytes`
  // go through pinned host memory into its slot of a device buffer, on an
  // internal stream; one in-place ncclAllGather; the whole buffer back into
  // pinned memory, and await() (so the timeout and the abort hold, and no
  // copy to pageable memory can block the host). NCCL runs a communicator's
  // operations in the order they were issued, so this also waits for the
  // collectives enqueued before it on other streams (no caller relies on
  // that order).
  void gather_through_nccl(const void* input, void* output, size_t bytes, const char* op) {
    require_usable(op);
    if (bytes == 0) return;
    cuda::DeviceGuard guard(device().index);
    const size_t total = bytes * static_cast<size_t>(size());
    reserve_exchange(total);
    unsigned char* host = exchange_host_.get();
    auto* staged = static_cast<unsigned char*>(exchange_device_.data());
    const size_t mine = static_cast<size_t>(rank()) * bytes;
    std::memcpy(host + mine, input, bytes);
    GRADKIT_CUDA_CHECK(
        cudaMemcpyAsync(staged + mine, host + mine, bytes, cudaMemcpyHostToDevice, exchange_stream_));
    issue("ncclAllGather", exchange_stream_,
          [&] { return ncclAllGather(staged + mine, staged, bytes, ncclUint8, comm_, exchange_stream_); });
    GRADKIT_CUDA_CHECK(cudaMemcpyAsync(host, staged, total, cudaMemcpyDeviceToHost, exchange_stream_));
    await(exchange_stream_, op);
    std::memcpy(output, host, total);
  }

  // The staging buffers of gather_through_nccl, at least `bytes` long
  // (grow-only). Only the second exchange of a checked-mode size mismatch
  // on a list of thousands of tensors outgrows what start() makes.
  void reserve_exchange(size_t bytes) {
    if (exchange_device_.bytes() >= bytes) return;
    exchange_host_.reset();
    exchange_device_ = Buffer();
    exchange_device_ = Buffer(device(), bytes);
    void* pinned = nullptr;
    GRADKIT_CUDA_CHECK(cudaMallocHost(&pinned, bytes));
    exchange_host_.reset(static_cast<unsigned char*>(pinned));
  }

  // A non-blocking communicator may answer ncclInProgress: the call is
  // still being set up, and nothing else may be issued until it has
  // settled. Polls until it has, within the timeout; aborts on failure.
  void settle(ncclResult_t result, const char* call, const char* file, int line) {
    const auto start = std::chrono::steady_clock::now();
    while (result == ncclInProgress) {
      if (comm_ == nullptr) break;
      if (std::chrono::steady_clock::now() - start > timeout()) {
        abort_and_throw(ncclInProgress, call,
                        "did not settle within " + std::to_string(timeout().count()) + " ms (a peer has not joined)",
                        file, line);
      }
      std::this_thread::yield();
      GRADKIT_NCCL_CHECK(ncclCommGetAsyncError(comm_, &result));
    }
    if (result != ncclSuccess) abort_and_throw(result, call, ncclGetLastError(comm_), file, line);
  }

  // With blocking calls, a failure that the watchdog caused (a call that it
  // interrupted, or refused after revoking) is reported by its cause.
  [[noreturn]] void abort_and_throw(ncclResult_t status, const char* call, std::string detail,
                                    const char* file = __FILE__, int line = __LINE__) {
    if (watchdog_) {
      watchdog_->stop();  // after its revoke or abort, if any: then the communicator is this thread's alone
      if (watchdog_->fired()) {
        status = watchdog_->status();
        detail = watchdog_->reason();
      }
      if (watchdog_->aborted()) comm_ = nullptr;
    }
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    try {
      comm::throw_nccl_error(status, call, file, line, detail + "; the communicator was aborted");
    } catch (const Error& e) {
      mark_unusable(e.what());
      throw;
    }
  }

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

  std::unique_ptr<comm::MpiChannel> channel_;  // null: made from a unique id
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
  void create_pipeline() {
    if (reduce_stream_ != nullptr) return;
    int least = 0, greatest = 0;
    GRADKIT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    GRADKIT_CUDA_CHECK(cudaStreamCreateWithPriority(&pack_stream_, cudaStreamNonBlocking, least));
    GRADKIT_CUDA_CHECK(cudaStreamCreateWithPriority(&unpack_stream_, cudaStreamNonBlocking, least));
    for (cudaEvent_t* e : {&fork_, &packed_, &reduced_, &reduce_done_, &unpack_done_}) {
      GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
    // Last: it marks the whole set as made.
    GRADKIT_CUDA_CHECK(cudaStreamCreateWithPriority(&reduce_stream_, cudaStreamNonBlocking, greatest));
  }

  std::shared_ptr<const comm::FusionCopyPlan> copy_plan(std::span<const TensorView> tensors, unsigned char* fusion,
                                                        DType dtype) {
    return copy_plans_.get({tensors}, {reinterpret_cast<uintptr_t>(fusion), static_cast<uint64_t>(dtype)},
                           [&] { return std::make_shared<const comm::FusionCopyPlan>(tensors, fusion, dtype); });
  }

  comm::LayoutCache<comm::FusionCopyPlan> copy_plans_{comm::kLayoutsKept};
  comm::LayoutCache<comm::SplitPlan> split_plans_{comm::kLayoutsKept};
  cudaStream_t pack_stream_ = nullptr, reduce_stream_ = nullptr, unpack_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, packed_ = nullptr, reduced_ = nullptr, reduce_done_ = nullptr,
              unpack_done_ = nullptr;
};

}  // namespace

bool has_nccl_communicator() { return true; }

std::unique_ptr<Communicator> create_nccl_communicator(const CommunicatorOptions& options, MpiCommHandle comm) {
  constexpr std::string_view op = "create_nccl_communicator";
  if (options.timeout.count() <= 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.timeout",
                         "is " + std::to_string(options.timeout.count()) + " ms, expected > 0");
  }
  auto channel = std::make_unique<comm::MpiChannel>(comm, options.timeout);
  const int index = options.cuda_device >= 0 ? options.cuda_device : channel->local_rank();
  const int visible = backend::cuda_device_count();
  // Every rank learns whether every rank has its GPU before any of them
  // starts NCCL, so that a host short of GPUs fails everywhere at once
  // instead of leaving the others waiting.
  const int mine = index < visible ? 1 : 0;
  std::vector<int> ready(static_cast<size_t>(channel->size()));
  channel->all_gather_bytes(&mine, ready.data(), sizeof(int));
  for (int r = 0; r < channel->size(); ++r) {
    if (ready[static_cast<size_t>(r)] != 0) continue;
    if (r == channel->rank()) {
      throw Error(ErrorCode::backend_unavailable,
                  std::string(op) + ": rank " + std::to_string(r) + " (local rank " +
                      std::to_string(channel->local_rank()) + " of " + std::to_string(channel->local_size()) +
                      ") needs cuda:" + std::to_string(index) + ", but " + std::to_string(visible) +
                      " CUDA device(s) are visible on its host");
    }
    throw Error(ErrorCode::backend_unavailable,
                std::string(op) + ": rank " + std::to_string(r) + " has no GPU for its local rank; no rank starts NCCL");
  }
  ncclUniqueId id{};
  if (channel->rank() == 0) GRADKIT_NCCL_CHECK(ncclGetUniqueId(&id));
  channel->broadcast_bytes(&id, sizeof(id), 0);
  const int rank = channel->rank(), size = channel->size();
  const int local_rank = channel->local_rank(), local_size = channel->local_size();
  auto c = std::make_unique<NcclCommunicator>(rank, size, local_rank, local_size, index, options, std::move(channel));
  c->start(id);
  return c;
}

NcclUniqueId create_nccl_unique_id() {
  ncclUniqueId id{};
  GRADKIT_NCCL_CHECK(ncclGetUniqueId(&id));
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

std::unique_ptr<Communicator> create_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                       const CommunicatorOptions& options) {
  constexpr std::string_view op = "create_nccl_communicator";
  // Every argument before any NCCL call: a rank that fails here never joins,
  // and the others give up after their timeout.
  if (size < 1) {
    throw_argument_error(ErrorCode::invalid_argument, op, "size", "is " + std::to_string(size) + ", expected >= 1");
  }
  if (rank < 0 || rank >= size) {
    throw_argument_error(ErrorCode::invalid_argument, op, "rank",
                         "is " + std::to_string(rank) + ", expected 0 <= rank < size (" + std::to_string(size) + ")");
  }
  if (options.timeout.count() <= 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.timeout",
                         "is " + std::to_string(options.timeout.count()) + " ms, expected > 0");
  }
  if (options.cuda_device < -1) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.cuda_device",
                         "is " + std::to_string(options.cuda_device) +
                             ", expected -1 (the current device) or a CUDA device ordinal");
  }
  const int visible = backend::cuda_device_count();
  if (visible == 0) {
    throw Error(ErrorCode::backend_unavailable,
                std::string(op) + ": rank " + std::to_string(rank) + " sees no CUDA device");
  }
  if (options.cuda_device >= visible) {
    throw_argument_error(ErrorCode::invalid_argument, op, "options.cuda_device",
                         "is " + std::to_string(options.cuda_device) + ", expected -1 (the current device) or < " +
                             std::to_string(visible) + " (the CUDA devices visible)");
  }
  int index = options.cuda_device;
  if (index < 0) GRADKIT_CUDA_CHECK(cudaGetDevice(&index));
  ncclUniqueId nccl_id{};
  std::memcpy(&nccl_id, id.bytes.data(), sizeof(nccl_id));
  // The local layout is a placeholder until start() has gathered the host names.
  auto c = std::make_unique<NcclCommunicator>(rank, size, 0, 1, index, options, nullptr);
  c->start(nccl_id);
  return c;
}

}  // namespace gradkit
