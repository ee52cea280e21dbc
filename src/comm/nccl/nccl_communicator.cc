// The NCCL communicator: GPU memory, collectives enqueued on the caller's
// stream. It is created from MPI (rank 0's unique id broadcast over the
// MpiChannel, which it keeps for checked mode and barriers) as a
// non-blocking NCCL communicator, so that no NCCL call can block the host:
// every call is followed by polling ncclCommGetAsyncError, bounded by the
// timeout, and a communicator that runs out of time or reports an error is
// aborted (ncclCommAbort) and throws.
#include <chrono>
#include <memory>
#include <thread>

#include "backend/cuda_runtime.h"
#include "comm/mpi/mpi_channel.h"
#include "comm/nccl/divide.h"
#include "comm/nccl/nccl_check.h"
#include "cuda/check.h"

namespace gradkit {

namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::f64: return ncclFloat64;
  }
  return ncclFloat32;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::unique_ptr<comm::MpiChannel> channel, int cuda_device, const CommunicatorOptions& options)
      : Communicator(channel->rank(), channel->size(), channel->local_rank(), channel->local_size(),
                     Device::cuda(cuda_device), options),
        channel_(std::move(channel)) {
    cuda::DeviceGuard guard(cuda_device);
    ncclUniqueId id{};
    if (rank() == 0) GRADKIT_NCCL_CHECK(ncclGetUniqueId(&id));
    channel_->broadcast_bytes(&id, sizeof(id), 0);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; settle() polls with the timeout
    settle(ncclCommInitRankConfig(&comm_, size(), id, rank(), &config), "ncclCommInitRankConfig", __FILE__,
           __LINE__);
    GRADKIT_CUDA_CHECK(cudaEventCreateWithFlags(&fusion_free_, cudaEventDisableTiming));
  }

  ~NcclCommunicator() override {
    try {
      cuda::DeviceGuard guard(device().index);
      if (comm_ != nullptr) {
        // Finalize flushes what is still queued; if that does not finish in
        // time the communicator is aborted rather than leaked in a hang.
        ncclResult_t state = ncclCommFinalize(comm_);
        const auto start = std::chrono::steady_clock::now();
        while (state == ncclInProgress && std::chrono::steady_clock::now() - start < timeout()) {
          std::this_thread::yield();
          if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
        }
        if (state == ncclSuccess) ncclCommDestroy(comm_);
        else ncclCommAbort(comm_);
      }
      if (fusion_free_ != nullptr) cudaEventDestroy(fusion_free_);
    } catch (...) {
      // A destructor must not throw; the device is gone or unusable anyway.
    }
  }

  std::string_view backend_name() const override { return "nccl"; }

  void wait(Stream stream) override {
    require_usable("wait");
    cuda::DeviceGuard guard(device().index);
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t done = cudaStreamQuery(cuda::native(stream));
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady) GRADKIT_CUDA_CHECK(done);
      ncclResult_t state = ncclSuccess;
      GRADKIT_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state != ncclSuccess && state != ncclInProgress) {
        abort_and_throw(state, "wait", "a peer or the network failed while the stream's collectives ran");
      }
      if (std::chrono::steady_clock::now() - start > timeout()) {
        abort_and_throw(ncclInProgress, "wait",
                        "the stream's collectives did not finish within " + std::to_string(timeout().count()) +
                            " ms: another rank has not joined (it died, hangs, or makes a different call)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 protected:
  void do_all_reduce(const void* input, void* output, int64_t count, DType dtype, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    settle(ncclAllReduce(input, output, static_cast<size_t>(count), nccl_type(dtype), ncclSum, comm_,
                         cuda::native(stream)),
           "ncclAllReduce", __FILE__, __LINE__);
  }

  void do_all_gather(const void* input, void* output, int64_t count, DType dtype, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    settle(ncclAllGather(input, output, static_cast<size_t>(count), nccl_type(dtype), comm_, cuda::native(stream)),
           "ncclAllGather", __FILE__, __LINE__);
  }

  void do_reduce_scatter(const void* input, void* output, int64_t count, DType dtype, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    settle(ncclReduceScatter(input, output, static_cast<size_t>(count), nccl_type(dtype), ncclSum, comm_,
                             cuda::native(stream)),
           "ncclReduceScatter", __FILE__, __LINE__);
  }

  void do_exchange(const void* send, void* receive, size_t bytes, int peer, Stream stream) override {
    cuda::DeviceGuard guard(device().index);
    GRADKIT_NCCL_CHECK(ncclGroupStart());
    const ncclResult_t sent = ncclSend(send, bytes, ncclUint8, peer, comm_, cuda::native(stream));
    const ncclResult_t received = ncclRecv(receive, bytes, ncclUint8, peer, comm_, cuda::native(stream));
    // The group must be closed whatever happened inside it.
    const ncclResult_t ended = ncclGroupEnd();
    if (sent != ncclSuccess && sent != ncclInProgress) settle(sent, "ncclSend", __FILE__, __LINE__);
    if (received != ncclSuccess && received != ncclInProgress) settle(received, "ncclRecv", __FILE__, __LINE__);
    settle(ended, "ncclGroupEnd", __FILE__, __LINE__);
  }

  void do_barrier() override { guarded([&] { channel_->barrier(); }); }

  void host_all_gather(const void* input, void* output, size_t bytes) override {
    guarded([&] { channel_->all_gather_bytes(input, output, bytes); });
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

 private:
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

  [[noreturn]] void abort_and_throw(ncclResult_t status, const char* call, const std::string& detail,
                                    const char* file = __FILE__, int line = __LINE__) {
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

  std::unique_ptr<comm::MpiChannel> channel_;
  ncclComm_t comm_ = nullptr;
  cudaEvent_t fusion_free_ = nullptr;
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
  return std::make_unique<NcclCommunicator>(std::move(channel), index, options);
}

}  // namespace gradkit
