#include <algorithm>
#include <cstdint>

#include "spec/fusion_copy.h"
#include "cuda/check.h"
#include "cuda/multi_tensor.cuh"

namespace gradkit::comm {

namespace {

using cuda::for_each_group;
using cuda::load;
using cuda::PlanArgs;
using cuda::store;

// A copy moves bits: elements are handled as unsigned integers of their size.
// List 0 of the plan is the tensors, list 1 their places in the fusion
// buffer; a chunk copies only its part inside [begin, end) of the
// concatenation.
template <class T>
struct FusionCopyOp {
  static constexpr int N = 16 / sizeof(T);
  static constexpr int kUnroll = 4;
  const T* fusion;  // element 0 of the concatenation
  int64_t begin;
  int64_t end;
  bool to_fusion;

  __device__ void operator()(const PlanArgs& plan, const PlanChunk& c) const {
    T* tensor = plan.tensor<T>(0, c);
    T* fused = plan.tensor<T>(1, c);
    const int64_t flat = fused - fusion;
    const int64_t lo = begin > flat ? begin : flat;
    const int64_t hi = end < flat + c.length ? end : flat + c.length;
    if (lo >= hi) return;
    // The offset into the chunk as an int (a chunk is at most 64K elements):
    // with the 64-bit difference added to the pointers, nvcc 13 for sm_90
    // splits the 16-byte stores below into 4-byte ones, at about half the
    // copy bandwidth.
    const int offset = static_cast<int>(lo - flat);
    const T* src = (to_fusion ? tensor : fused) + offset;
    T* dst = (to_fusion ? fused : tensor) + offset;
    int length = static_cast<int>(hi - lo);
    // The elements before dst's first 16-byte boundary one by one; the rest
    // in 16-byte vectors when src is then aligned too (tensors 40 bytes
    // apart, or a range starting inside a vector, are not).
    const int head = std::min<int>(length, static_cast<int>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16 / sizeof(T)));
    for (int j = threadIdx.x; j < head; j += blockDim.x) dst[j] = src[j];
    src += head;
    dst += head;
    length -= head;
    const bool vectorized = cuda::vector_aligned<N>(src) && cuda::vector_aligned<N>(dst);
    for_each_group<N, kUnroll>(
        length, vectorized,
        [&]<int U>(int i, int stride, bool vec) {
          T v[U][N];
#pragma unroll
          for (int u = 0; u < U; ++u) load<N>(v[u], src + i + u * stride, vec);
#pragma unroll
          for (int u = 0; u < U; ++u) store<N>(dst + i + u * stride, v[u], vec);
        },
        [&](int j) { dst[j] = src[j]; });
  }
};

template <class T>
void launch(const MultiTensorPlan& plan, int64_t first, int64_t last, const unsigned char* fusion, int64_t begin,
            int64_t end, bool to_fusion, cudaStream_t stream) {
  // The driver's kernel over the slice [first, last) of the chunk table: block
  // b runs chunk first + b.
  PlanArgs args = cuda::plan_args(plan);
  args.chunks += first;
  args.num_chunks = last - first;
  const FusionCopyOp<T> op{reinterpret_cast<const T*>(fusion), begin, end, to_fusion};
  static_assert(cuda::chunk_parts<FusionCopyOp<T>>() == 1, "block b runs chunk first + b");
  cuda::multi_tensor_kernel<<<static_cast<unsigned>(last - first), cuda::block_threads<FusionCopyOp<T>>(), 0, stream>>>(
      args, op);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace

FusionCopyPlan::FusionCopyPlan(std::span<const TensorView> tensors, unsigned char* fusion, DType dtype)
    : fusion_(fusion), dtype_(dtype) {
  std::vector<TensorView> places;
  places.reserve(tensors.size());
  int64_t offset = 0;
  for (const TensorView& t : tensors) {
    places.push_back({fusion + static_cast<size_t>(offset) * dtype_size(dtype), t.numel, dtype, t.device});
    offset += t.numel;
  }
  // The collectives have already checked the written tensors against each
  // other and against the inputs; here the tensors are marked read-only so
  // that one plan serves both directions (an out-of-place input list may
  // hold the same tensor twice).
  const PlanList lists[] = {{"tensors", tensors, false}, {"fusion", places, true}};
  plan_ = MultiTensorPlan("fusion buffer copy", lists);
  if (plan_.empty()) return;
  const std::span<const PlanChunk> chunks = plan_.chunks();
  std::vector<int64_t> tensor_begin(tensors.size());
  offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensor_begin[i] = offset;
    offset += tensors[i].numel;
  }
  chunk_begin_.reserve(chunks.size());
  for (const PlanChunk& c : chunks) chunk_begin_.push_back(tensor_begin[static_cast<size_t>(c.tensor)] + c.begin);
}

void FusionCopyPlan::copy(int64_t begin, int64_t end, bool to_fusion, cudaStream_t stream) const {
  if (plan_.empty() || begin >= end) return;
  // The chunks tile the concatenation in order: the first to launch is the
  // last one starting at or before `begin`, the end the first starting at or
  // after `end`.
  const auto first_it = std::upper_bound(chunk_begin_.begin(), chunk_begin_.end(), begin);
  const int64_t first = std::max<int64_t>(0, (first_it - chunk_begin_.begin()) - 1);
  const int64_t last = std::lower_bound(chunk_begin_.begin(), chunk_begin_.end(), end) - chunk_begin_.begin();
  if (first >= last) return;
  cuda::DeviceGuard guard(plan_.device().index);
  switch (dtype_size(dtype_)) {
    case 2: return launch<uint16_t>(plan_, first, last, fusion_, begin, end, to_fusion, stream);
    case 4: return launch<uint32_t>(plan_, first, last, fusion_, begin, end, to_fusion, stream);
    case 8: return launch<uint64_t>(plan_, first, last, fusion_, begin, end, to_fusion, stream);
    default:
      throw Error(ErrorCode::dtype_unsupported,
                  "fusion buffer copy: no copy for elements of " + std::to_string(dtype_size(dtype_)) + " bytes");
  }
}

}  // namespace gradkit::comm
