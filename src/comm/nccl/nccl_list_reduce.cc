// NcclCommunicator (nccl_communicator.h): list_all_reduce's two paths (large
// tensors where they lie and small ones through the fusion buffer; or the
// whole list through the fusion buffer in pipelined pieces) and the fusion
// buffer's copies.
#include <algorithm>
#include <memory>
#include <span>

#include "spec/nccl_divide.h"
#include "comm/nccl/nccl_communicator.h"
#include "cuda/check.h"

namespace gradkit::comm {

void NcclCommunicator::pack(std::span<const TensorView> inputs, unsigned char* fusion, int64_t begin, int64_t end,
                            Stream stream) {
  if (begin >= end) return;
  copy_plan(inputs, fusion, inputs[0].dtype)->copy(begin, end, /*to_fusion=*/true, cuda::native(stream));
}

void NcclCommunicator::unpack(const unsigned char* fusion, std::span<const TensorView> outputs, int64_t begin,
                              int64_t end, Stream stream) {
  if (begin >= end) return;
  copy_plan(outputs, const_cast<unsigned char*>(fusion), outputs[0].dtype)
      ->copy(begin, end, /*to_fusion=*/false, cuda::native(stream));
}

void NcclCommunicator::list_all_reduce(const ListReduce& r, Stream stream) {
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

uint32_t NcclCommunicator::list_settings() const {
  // FNV-1a over the two settings that shape list_all_reduce's collectives.
  uint32_t hash = 2166136261u;
  for (uint64_t v : {static_cast<uint64_t>(direct_tensor_bytes()), static_cast<uint64_t>(fusion_pipeline_bytes())}) {
    for (int byte = 0; byte < 8; ++byte, v >>= 8) hash = (hash ^ static_cast<uint32_t>(v & 0xff)) * 16777619u;
  }
  return hash;
}

void NcclCommunicator::split_all_reduce(const comm::SplitPlan& split, const ListReduce& r, Stream stream) {
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
      add(nccl().ncclAllReduce(fusion, fusion, static_cast<size_t>(packed), type, ncclSum, comm_, s), "ncclAllReduce");
      return;
    }
    const comm::SplitPlan::Direct& d = direct[k - first_direct];
    add(nccl().ncclAllReduce(d.input, d.output, static_cast<size_t>(d.count), type, ncclSum, comm_, s), "ncclAllReduce");
  });
  if (packed > 0) {
    copy_plan(split.packed_outputs(), fusion, r.dtype)->copy(0, packed, /*to_fusion=*/false, s);
    fusion_end(stream);
  }
  if (r.reduce == ReduceOp::average) comm::divide_on_device(split.divide_plan(), size(), s);
}

void NcclCommunicator::pipelined_all_reduce(const ListReduce& r, Stream stream) {
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

void NcclCommunicator::create_pipeline() {
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

std::shared_ptr<const comm::FusionCopyPlan> NcclCommunicator::copy_plan(std::span<const TensorView> tensors,
                                                                        unsigned char* fusion, DType dtype) {
  return copy_plans_.get({tensors}, {reinterpret_cast<uintptr_t>(fusion), static_cast<uint64_t>(dtype)},
                         [&] { return std::make_shared<const comm::FusionCopyPlan>(tensors, fusion, dtype); });
}

}  // namespace gradkit::comm
