// NcclCommunicator (nccl_communicator.h): start-up and release, the
// collectives, and waiting for and failing on the communicator's work.
#include "comm/nccl/nccl_communicator.h"

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

#include "spec/cuda_runtime.h"
#include "spec/nccl_divide.h"
#include "cuda/check.h"

namespace gradkit::comm {

void NcclCommunicator::start(const ncclUniqueId& id) {
  cuda::DeviceGuard guard(device().index);
  GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&fusion_free_, cudaEventDisableTiming));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; settle() polls with the timeout
  settle(nccl().ncclCommInitRankConfig(&comm_, size(), id, rank(), &config), "ncclCommInitRankConfig", __FILE__,
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

void NcclCommunicator::switch_to_blocking_calls() {
  ncclUniqueId id{};
  if (rank() == 0) GRADKIT_NCCL_CHECK(nccl().ncclGetUniqueId(&id));
  std::vector<ncclUniqueId> all(static_cast<size_t>(size()));
  host_all_gather(&id, all.data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t blocking = nullptr;
  const ncclResult_t made = nccl().ncclCommInitRankConfig(&blocking, size(), all[0], rank(), &config);
  if (made != ncclSuccess) {
    // Nothing to abort of the blocking one: a failed init leaves no communicator.
    abort_and_throw(made, "ncclCommInitRankConfig (blocking calls)", nccl().ncclGetLastError(nullptr));
  }
  release_non_blocking(std::exchange(comm_, blocking));
  watchdog_ = std::make_unique<comm::NcclWatchdog>(comm_, device().index, timeout());
}

void NcclCommunicator::release_non_blocking(ncclComm_t comm) {
  ncclResult_t state = nccl().ncclCommFinalize(comm);
  const auto start = std::chrono::steady_clock::now();
  while (state == ncclInProgress && std::chrono::steady_clock::now() - start < timeout()) {
    std::this_thread::yield();
    if (nccl().ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
  }
  if (state == ncclSuccess) nccl().ncclCommDestroy(comm);
  else nccl().ncclCommAbort(comm);
}

void NcclCommunicator::release_blocking() {
  ncclResult_t finalized = ncclInternalError;
  {
    const comm::NcclWatchdog::InCall inside(*watchdog_, "ncclCommFinalize");
    watchdog_->finalizing();  // first: a watchdog that fires from here on aborts, after this call
    if (!watchdog_->fired()) finalized = nccl().ncclCommFinalize(comm_);
  }
  watchdog_->stop();
  if (watchdog_->aborted()) return;
  if (finalized == ncclSuccess) nccl().ncclCommDestroy(comm_);
  else nccl().ncclCommAbort(comm_);
}

NcclCommunicator::~NcclCommunicator() {
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

void NcclCommunicator::wait(Stream stream) {
  require_usable("wait");
  cuda::DeviceGuard guard(device().index);
  await(cuda::native(stream), "wait");
}

void NcclCommunicator::do_all_reduce(const void* input, void* output, int64_t count, DType dtype, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  issue("ncclAllReduce", s, [&] {
    return nccl().ncclAllReduce(input, output, static_cast<size_t>(count), nccl_type(dtype), ncclSum, comm_, s);
  });
}

void NcclCommunicator::do_all_gather(const void* input, void* output, int64_t count, DType dtype, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  issue("ncclAllGather", s,
        [&] { return nccl().ncclAllGather(input, output, static_cast<size_t>(count), nccl_type(dtype), comm_, s); });
}

void NcclCommunicator::do_reduce_scatter(const void* input, void* output, int64_t count, DType dtype, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  issue("ncclReduceScatter", s, [&] {
    return nccl().ncclReduceScatter(input, output, static_cast<size_t>(count), nccl_type(dtype), ncclSum, comm_, s);
  });
}

void NcclCommunicator::do_all_gathers(std::span<const BufferCall> calls, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  grouped_in_batches("a group of ncclAllGather", calls.size(), s, [&](size_t k, auto&& add) {
    const BufferCall& c = calls[k];
    add(nccl().ncclAllGather(c.input, c.output, static_cast<size_t>(c.count_per_rank), nccl_type(c.dtype), comm_, s),
        "ncclAllGather");
  });
}

void NcclCommunicator::do_reduce_scatters(std::span<const BufferCall> calls, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  grouped_in_batches("a group of ncclReduceScatter", calls.size(), s, [&](size_t k, auto&& add) {
    const BufferCall& c = calls[k];
    add(nccl().ncclReduceScatter(c.input, c.output, static_cast<size_t>(c.count_per_rank), nccl_type(c.dtype), ncclSum,
                          comm_, s),
        "ncclReduceScatter");
  });
}

void NcclCommunicator::do_exchange(const void* send, void* receive, size_t bytes, int peer, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  grouped("ncclSend and ncclRecv", s, [&](auto&& add) {
    add(nccl().ncclSend(send, bytes, ncclUint8, peer, comm_, s), "ncclSend");
    add(nccl().ncclRecv(receive, bytes, ncclUint8, peer, comm_, s), "ncclRecv");
  });
}

void NcclCommunicator::do_all_to_all(const void* send, const Sections& to, void* receive, const Sections& from,
                                     Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  const auto* out = static_cast<const unsigned char*>(send);
  auto* in = static_cast<unsigned char*>(receive);
  const auto me = static_cast<size_t>(rank());
  // This rank's own section is a copy; the others one send and one receive
  // each, in one group.
  if (to.bytes[me] > 0) copy(in + from.offsets[me], out + to.offsets[me], to.bytes[me], stream);
  grouped("ncclSend and ncclRecv (all_to_all)", s, [&](auto&& add) {
    for (size_t r = 0; r < to.bytes.size(); ++r) {
      if (r == me) continue;
      const int peer = static_cast<int>(r);
      if (to.bytes[r] > 0) add(nccl().ncclSend(out + to.offsets[r], to.bytes[r], ncclUint8, peer, comm_, s), "ncclSend");
      if (from.bytes[r] > 0) add(nccl().ncclRecv(in + from.offsets[r], from.bytes[r], ncclUint8, peer, comm_, s), "ncclRecv");
    }
  });
}

void NcclCommunicator::do_send(const void* data, size_t bytes, int peer, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  issue("ncclSend", s, [&] { return nccl().ncclSend(data, bytes, ncclUint8, peer, comm_, s); });
}

void NcclCommunicator::do_receive(void* data, size_t bytes, int peer, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  const cudaStream_t s = cuda::native(stream);
  issue("ncclRecv", s, [&] { return nccl().ncclRecv(data, bytes, ncclUint8, peer, comm_, s); });
}

void NcclCommunicator::do_barrier() {
  if (channel_) {
    guarded([&] { channel_->barrier(); });
    return;
  }
  const unsigned char mine = 1;
  std::vector<unsigned char> all(static_cast<size_t>(size()));
  gather_through_nccl(&mine, all.data(), 1, "barrier");
}

void NcclCommunicator::host_all_gather(const void* input, void* output, size_t bytes) {
  if (channel_) {
    guarded([&] { channel_->all_gather_bytes(input, output, bytes); });
    return;
  }
  gather_through_nccl(input, output, bytes, "host_all_gather");
}

void NcclCommunicator::copy(void* destination, const void* source, size_t bytes, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  GRADKIT_CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, cuda::native(stream)));
}

void NcclCommunicator::fill_zero(void* destination, size_t bytes, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  GRADKIT_CUDA_CHECK(cudaMemsetAsync(destination, 0, bytes, cuda::native(stream)));
}

void NcclCommunicator::divide(void* data, int64_t count, DType dtype, int divisor, Stream stream) {
  cuda::DeviceGuard guard(device().index);
  comm::divide_on_device(data, count, dtype, divisor, cuda::native(stream));
}

void NcclCommunicator::fusion_begin(Stream stream) {
  cuda::DeviceGuard guard(device().index);
  GRADKIT_CUDA_CHECK(cudaStreamWaitEvent(cuda::native(stream), fusion_free_, 0));
}

void NcclCommunicator::fusion_end(Stream stream) {
  cuda::DeviceGuard guard(device().index);
  GRADKIT_CUDA_CHECK(cudaEventRecord(fusion_free_, cuda::native(stream)));
}

void NcclCommunicator::await(cudaStream_t stream, const char* op) {
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
    if (!watchdog_) GRADKIT_NCCL_CHECK(nccl().ncclCommGetAsyncError(comm_, &state));
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

void NcclCommunicator::gather_through_nccl(const void* input, void* output, size_t bytes, const char* op) {
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
        [&] { return nccl().ncclAllGather(staged + mine, staged, bytes, ncclUint8, comm_, exchange_stream_); });
  GRADKIT_CUDA_CHECK(cudaMemcpyAsync(host, staged, total, cudaMemcpyDeviceToHost, exchange_stream_));
  await(exchange_stream_, op);
  std::memcpy(output, host, total);
}

void NcclCommunicator::reserve_exchange(size_t bytes) {
  if (exchange_device_.bytes() >= bytes) return;
  exchange_host_.reset();
  exchange_device_ = Buffer();
  exchange_device_ = Buffer(device(), bytes);
  void* pinned = nullptr;
  GRADKIT_CUDA_CHECK(cudaMallocHost(&pinned, bytes));
  exchange_host_.reset(static_cast<unsigned char*>(pinned));
}

void NcclCommunicator::settle(ncclResult_t result, const char* call, const char* file, int line) {
  const auto start = std::chrono::steady_clock::now();
  while (result == ncclInProgress) {
    if (comm_ == nullptr) break;
    if (std::chrono::steady_clock::now() - start > timeout()) {
      abort_and_throw(ncclInProgress, call,
                      "did not settle within " + std::to_string(timeout().count()) + " ms (a peer has not joined)",
                      file, line);
    }
    std::this_thread::yield();
    GRADKIT_NCCL_CHECK(nccl().ncclCommGetAsyncError(comm_, &result));
  }
  if (result != ncclSuccess) abort_and_throw(result, call, nccl().ncclGetLastError(comm_), file, line);
}

void NcclCommunicator::abort_and_throw(ncclResult_t status, const char* call, std::string detail, const char* file,
                                       int line) {
  if (watchdog_) {
    watchdog_->stop();  // after its revoke or abort, if any: then the communicator is this thread's alone
    if (watchdog_->fired()) {
      status = watchdog_->status();
      detail = watchdog_->reason();
    }
    if (watchdog_->aborted()) comm_ = nullptr;
  }
  if (comm_ != nullptr) {
    nccl().ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  try {
    comm::throw_nccl_error(status, call, file, line, detail + "; the communicator was aborted");
  } catch (const Error& e) {
    mark_unusable(e.what());
    throw;
  }
}

}  // namespace gradkit::comm
