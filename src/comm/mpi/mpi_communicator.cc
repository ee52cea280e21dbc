// The MPI communicator: host memory, every call complete when it returns.
// Collectives are started non-blocking and polled (MpiChannel::wait), so the
// timeout holds for them too. f16 and bf16 travel as 16-bit words and are
// summed by user-defined operations that add in f32 and round once per
// addition, as NCCL does.
#include <cstring>
#include <memory>
#include <vector>

#include "comm/mpi/mpi_channel.h"
#include "comm/mpi/mpi_check.h"
#include "comm/host_divide.h"

namespace gradkit {

namespace {

template <class T>
void sum_16bit(void* input, void* inout, int* length, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(input);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::unique_ptr<comm::MpiChannel> channel, const CommunicatorOptions& options)
      : Communicator(channel->rank(), channel->size(), channel->local_rank(), channel->local_size(), Device::cpu(),
                     options),
        channel_(std::move(channel)) {
    GRADKIT_MPI_CHECK(MPI_Op_create(&sum_16bit<half>, 1, &sum_f16_));
    GRADKIT_MPI_CHECK(MPI_Op_create(&sum_16bit<bfloat16>, 1, &sum_bf16_));
  }

  ~MpiCommunicator() override {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (sum_f16_ != MPI_OP_NULL) MPI_Op_free(&sum_f16_);
    if (sum_bf16_ != MPI_OP_NULL) MPI_Op_free(&sum_bf16_);
  }

  std::string_view backend_name() const override { return "mpi"; }
  void wait(Stream) override { require_usable("wait"); }

 protected:
  void do_all_reduce(const void* input, void* output, int64_t count, DType dtype, Stream) override {
    MPI_Request request = MPI_REQUEST_NULL;
    GRADKIT_MPI_CHECK(MPI_Iallreduce(input == output ? MPI_IN_PLACE : input, output,
                                     comm::mpi_count("all_reduce", count), type_of(dtype), sum_of(dtype),
                                     channel_->comm(), &request));
    wait_for(request, "MPI_Iallreduce");
  }

  void do_all_gather(const void* input, void* output, int64_t count, DType dtype, Stream) override {
    const auto* slice = static_cast<const unsigned char*>(output) + static_cast<size_t>(count * rank()) * dtype_size(dtype);
    const int n = comm::mpi_count("all_gather", count);
    MPI_Request request = MPI_REQUEST_NULL;
    GRADKIT_MPI_CHECK(MPI_Iallgather(input == slice ? MPI_IN_PLACE : input, n, type_of(dtype), output, n,
                                     type_of(dtype), channel_->comm(), &request));
    wait_for(request, "MPI_Iallgather");
  }

  void do_reduce_scatter(const void* input, void* output, int64_t count, DType dtype, Stream) override {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
    const auto* slice = static_cast<const unsigned char*>(input) + bytes * static_cast<size_t>(rank());
    // MPI's in-place form puts the result at the start of the buffer, not at
    // this rank's slice; receive into scratch memory instead, so that no
    // element outside this rank's slice is written.
    const bool in_place = output == slice;
    if (in_place && scratch_.size() < bytes) scratch_.resize(bytes);
    void* receive = in_place ? scratch_.data() : output;
    MPI_Request request = MPI_REQUEST_NULL;
    GRADKIT_MPI_CHECK(MPI_Ireduce_scatter_block(input, receive, comm::mpi_count("reduce_scatter", count),
                                                type_of(dtype), sum_of(dtype), channel_->comm(), &request));
    wait_for(request, "MPI_Ireduce_scatter_block");
    if (in_place) std::memcpy(output, receive, bytes);
  }

  void do_exchange(const void* send, void* receive, size_t bytes, int peer, Stream) override {
    const int n = comm::mpi_count("exchange", static_cast<int64_t>(bytes));
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    GRADKIT_MPI_CHECK(MPI_Irecv(receive, n, MPI_BYTE, peer, kTag, channel_->comm(), &requests[0]));
    GRADKIT_MPI_CHECK(MPI_Isend(send, n, MPI_BYTE, peer, kTag, channel_->comm(), &requests[1]));
    try {
      channel_->wait_all(requests, "MPI_Irecv/MPI_Isend");
    } catch (const Error& e) {
      mark_unusable(e.what());
      throw;
    }
  }

  void do_all_to_all(const void* send, const Sections& to, void* receive, const Sections& from, Stream) override {
    const auto* out = static_cast<const unsigned char*>(send);
    auto* in = static_cast<unsigned char*>(receive);
    const auto me = static_cast<size_t>(rank());
    // Every message's count first (mpi_count refuses more than INT_MAX
    // bytes), so that a refusal leaves nothing posted and nothing copied.
    std::vector<int> to_count, from_count;
    for (size_t r = 0; r < to.bytes.size(); ++r) {
      to_count.push_back(comm::mpi_count("all_to_all", static_cast<int64_t>(to.bytes[r])));
      from_count.push_back(comm::mpi_count("all_to_all", static_cast<int64_t>(from.bytes[r])));
    }
    if (to.bytes[me] > 0) std::memcpy(in + from.offsets[me], out + to.offsets[me], to.bytes[me]);
    std::vector<MPI_Request> requests;
    for (size_t r = 0; r < to.bytes.size(); ++r) {
      if (r == me) continue;
      const int peer = static_cast<int>(r);
      if (from_count[r] > 0) {
        GRADKIT_MPI_CHECK(MPI_Irecv(in + from.offsets[r], from_count[r], MPI_BYTE, peer, kTag, channel_->comm(),
                                    &requests.emplace_back()));
      }
      if (to_count[r] > 0) {
        GRADKIT_MPI_CHECK(MPI_Isend(out + to.offsets[r], to_count[r], MPI_BYTE, peer, kTag, channel_->comm(),
                                    &requests.emplace_back()));
      }
    }
    if (requests.empty()) return;
    try {
      channel_->wait_all(requests, "MPI_Irecv/MPI_Isend (all_to_all)");
    } catch (const Error& e) {
      mark_unusable(e.what());
      throw;
    }
  }

  void do_send(const void* data, size_t bytes, int peer, Stream) override {
    MPI_Request request = MPI_REQUEST_NULL;
    GRADKIT_MPI_CHECK(MPI_Isend(data, comm::mpi_count("send", static_cast<int64_t>(bytes)), MPI_BYTE, peer, kTag,
                                channel_->comm(), &request));
    wait_for(request, "MPI_Isend");
  }

  void do_receive(void* data, size_t bytes, int peer, Stream) override {
    MPI_Request request = MPI_REQUEST_NULL;
    GRADKIT_MPI_CHECK(MPI_Irecv(data, comm::mpi_count("receive", static_cast<int64_t>(bytes)), MPI_BYTE, peer, kTag,
                                channel_->comm(), &request));
    wait_for(request, "MPI_Irecv");
  }

  void do_barrier() override {
    try {
      channel_->barrier();
    } catch (const Error& e) {
      mark_unusable(e.what());
      throw;
    }
  }

  void host_all_gather(const void* input, void* output, size_t bytes) override {
    try {
      channel_->all_gather_bytes(input, output, bytes);
    } catch (const Error& e) {
      mark_unusable(e.what());
      throw;
    }
  }

  void copy(void* destination, const void* source, size_t bytes, Stream) override {
    std::memcpy(destination, source, bytes);
  }
  void fill_zero(void* destination, size_t bytes, Stream) override { std::memset(destination, 0, bytes); }
  void divide(void* data, int64_t count, DType dtype, int divisor, Stream) override {
    comm::divide_on_host(data, count, dtype, divisor);
  }

 private:
  // gradkit's own communicator, and point-to-point messages between two
  // ranks arrive in the order sent: one tag is enough.
  static constexpr int kTag = 0x6b;

  void wait_for(MPI_Request& request, const char* call) {
    try {
      channel_->wait(request, call);
    } catch (const Error& e) {
      mark_unusable(e.what());
      throw;
    }
  }

  static MPI_Datatype type_of(DType dtype) {
    switch (dtype) {
      case DType::f32: return MPI_FLOAT;
      case DType::f64: return MPI_DOUBLE;
      case DType::f16:
      case DType::bf16: return MPI_UINT16_T;
      case DType::u8:
      case DType::i16: break;  // refused by inspect_list
    }
    return MPI_DATATYPE_NULL;
  }

  MPI_Op sum_of(DType dtype) const {
    if (dtype == DType::f16) return sum_f16_;
    if (dtype == DType::bf16) return sum_bf16_;
    return MPI_SUM;
  }

  std::unique_ptr<comm::MpiChannel> channel_;
  MPI_Op sum_f16_ = MPI_OP_NULL;
  MPI_Op sum_bf16_ = MPI_OP_NULL;
  std::vector<unsigned char> scratch_;  // in-place reduce-scatter; grow-only
};

}  // namespace

bool has_mpi_communicator() { return true; }

std::unique_ptr<Communicator> create_mpi_communicator(const CommunicatorOptions& options, MpiCommHandle comm) {
  if (options.timeout.count() <= 0) {
    throw_argument_error(ErrorCode::invalid_argument, "create_mpi_communicator", "options.timeout",
                         "is " + std::to_string(options.timeout.count()) + " ms, expected > 0");
  }
  return std::make_unique<MpiCommunicator>(std::make_unique<comm::MpiChannel>(comm, options.timeout), options);
}

}  // namespace gradkit
