// Adasum's arithmetic on the GPU: a block per piece (at most 64K elements of
// one tensor), f64 sums reduced in a fixed order (block_reduce, then the
// pieces of a tensor in order by one thread: no atomics), and the combine
// with explicitly rounded products and sum, so that no contraction into an
// FMA makes it differ from the host loops in cpu/adasum.cc. Every launch is
// on the caller's stream; nothing here waits for the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "spec/adasum.h"
#include "spec/adasum_math.h"
#include "cuda/block_reduce.cuh"
#include "cuda/check.h"
#include "cuda/types.cuh"

namespace gradkit::comm::adasum {

namespace {

using cuda::from_compute;
using cuda::native_t;
using cuda::to_compute;

constexpr int kThreads = 512;

template <class C> __device__ __forceinline__ C multiply(C x, C y);
template <> __device__ __forceinline__ float multiply(float x, float y) { return __fmul_rn(x, y); }
template <> __device__ __forceinline__ double multiply(double x, double y) { return __dmul_rn(x, y); }
template <class C> __device__ __forceinline__ C add(C x, C y);
template <> __device__ __forceinline__ float add(float x, float y) { return __fadd_rn(x, y); }
template <> __device__ __forceinline__ double add(double x, double y) { return __dadd_rn(x, y); }

template <class T>
using compute_of = cuda::compute_t<T>;  // f32, f64 for double

template <class T>
__global__ void __launch_bounds__(kThreads) copy_pieces_kernel(ListView list, T* flat, bool into_flat) {
  const Piece piece = list.pieces[blockIdx.x];
  T* tensor = static_cast<T*>(list.pointers[piece.tensor]) + (piece.begin - list.tensor_begin[piece.tensor]);
  T* at = flat + piece.begin;
  for (int i = threadIdx.x; i < piece.length; i += blockDim.x) {
    if (into_flat) at[i] = tensor[i];
    else tensor[i] = at[i];
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) add_kernel(T* mine, const T* theirs, int64_t count) {
  using C = compute_of<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    mine[i] = from_compute<T>(add(to_compute<C>(mine[i]), to_compute<C>(theirs[i])));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    piece_sums_kernel(TableView table, const T* flat, const T* received, int64_t keep_begin, bool mine_is_a) {
  using C = compute_of<T>;
  const Piece piece = table.pieces[blockIdx.x];
  const T* mine = flat + piece.begin;
  const T* theirs = received + (piece.begin - keep_begin);
  double dot = 0, norm_mine = 0, norm_theirs = 0;
  for (int i = threadIdx.x; i < piece.length; i += blockDim.x) {
    const auto m = static_cast<double>(to_compute<C>(mine[i]));
    const auto t = static_cast<double>(to_compute<C>(theirs[i]));
    dot += m * t;
    norm_mine += m * m;
    norm_theirs += t * t;
  }
  dot = cuda::block_reduce(dot, cuda::Plus{});
  norm_mine = cuda::block_reduce(norm_mine, cuda::Plus{});
  norm_theirs = cuda::block_reduce(norm_theirs, cuda::Plus{});
  if (threadIdx.x == 0) {
    double* out = table.piece_sums + 3 * static_cast<int64_t>(blockIdx.x);
    out[0] = dot;
    out[1] = mine_is_a ? norm_mine : norm_theirs;
    out[2] = mine_is_a ? norm_theirs : norm_mine;
  }
}

// One thread per slot adds its pieces' sums in piece order, as the host does.
__global__ void slot_sums_kernel(TableView table, double* sums) {
  const int slot = blockIdx.x * blockDim.x + threadIdx.x;
  if (slot >= table.num_slots) return;
  double total[3] = {0, 0, 0};
  for (int32_t p = table.first_piece[slot]; p < table.first_piece[slot + 1]; ++p) {
    for (int k = 0; k < 3; ++k) total[k] += table.piece_sums[3 * static_cast<int64_t>(p) + k];
  }
  for (int k = 0; k < 3; ++k) sums[3 * slot + k] = total[k];
}

__global__ void add_sums_kernel(double* sums, const double* theirs, int64_t count, bool theirs_first) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) sums[i] = theirs_first ? theirs[i] + sums[i] : sums[i] + theirs[i];
}

template <class T>
__global__ void __launch_bounds__(kThreads) combine_kernel(TableView table, T* flat, const T* received,
                                                           int64_t keep_begin, bool mine_is_a, const double* sums) {
  using C = compute_of<T>;
  const Piece piece = table.pieces[blockIdx.x];
  const double* s = sums + 3 * static_cast<int64_t>(piece.tensor);
  const Coefficients c = coefficients(s[0], s[1], s[2]);
  const auto ca = static_cast<C>(c.a), cb = static_cast<C>(c.b);
  T* mine = flat + piece.begin;
  const T* theirs = received + (piece.begin - keep_begin);
  for (int i = threadIdx.x; i < piece.length; i += blockDim.x) {
    const C m = to_compute<C>(mine[i]), t = to_compute<C>(theirs[i]);
    const C a = mine_is_a ? m : t, b = mine_is_a ? t : m;
    mine[i] = from_compute<T>(add(multiply(ca, a), multiply(cb, b)));
  }
}

template <class Fn>
void with_native_type(DType dtype, Fn&& fn) {
  dispatch_dtype(dtype, [&]<class T>() { fn.template operator()<native_t<T>>(); });
}

unsigned blocks_for(int64_t count, int threads) {
  // A grid-stride loop over at most 8192 blocks fills any GPU.
  return static_cast<unsigned>(std::clamp<int64_t>((count + threads - 1) / threads, 1, 8192));
}

class CudaAdasumDevice final : public AdasumDevice {
 public:
  explicit CudaAdasumDevice(int index) : index_(index) {}

  void pack(const ListView& list, void* flat, DType dtype, Stream stream) override {
    copy(list, flat, dtype, true, stream);
  }

  void unpack(const ListView& list, const void* flat, DType dtype, Stream stream) override {
    copy(list, const_cast<void*>(flat), dtype, false, stream);
  }

  void add(void* mine, const void* theirs, int64_t count, DType dtype, Stream stream) override {
    if (count == 0) return;
    cuda::DeviceGuard guard(index_);
    with_native_type(dtype, [&]<class T>() {
      add_kernel<T><<<blocks_for(count, kThreads), kThreads, 0, cuda::native(stream)>>>(
          static_cast<T*>(mine), static_cast<const T*>(theirs), count);
    });
    GRADKIT_CUDA_CHECK_LAUNCH();
  }

  void partial_sums(const TableView& table, const void* flat, const void* received, int64_t keep_begin,
                    bool mine_is_a, DType dtype, double* sums, Stream stream) override {
    cuda::DeviceGuard guard(index_);
    if (table.num_pieces > 0) {
      with_native_type(dtype, [&]<class T>() {
        piece_sums_kernel<T><<<static_cast<unsigned>(table.num_pieces), kThreads, 0, cuda::native(stream)>>>(
            table, static_cast<const T*>(flat), static_cast<const T*>(received), keep_begin, mine_is_a);
      });
      GRADKIT_CUDA_CHECK_LAUNCH();
    }
    constexpr int kSlotThreads = 128;
    slot_sums_kernel<<<static_cast<unsigned>((table.num_slots + kSlotThreads - 1) / kSlotThreads), kSlotThreads, 0,
                       cuda::native(stream)>>>(table, sums);
    GRADKIT_CUDA_CHECK_LAUNCH();
  }

  void add_sums(double* sums, const double* theirs, int64_t count, bool theirs_first, Stream stream) override {
    if (count == 0) return;
    cuda::DeviceGuard guard(index_);
    constexpr int kSumThreads = 256;
    add_sums_kernel<<<static_cast<unsigned>((count + kSumThreads - 1) / kSumThreads), kSumThreads, 0,
                      cuda::native(stream)>>>(sums, theirs, count, theirs_first);
    GRADKIT_CUDA_CHECK_LAUNCH();
  }

  void combine(const TableView& table, void* flat, const void* received, int64_t keep_begin, bool mine_is_a,
               DType dtype, const double* sums, Stream stream) override {
    if (table.num_pieces == 0) return;
    cuda::DeviceGuard guard(index_);
    with_native_type(dtype, [&]<class T>() {
      combine_kernel<T><<<static_cast<unsigned>(table.num_pieces), kThreads, 0, cuda::native(stream)>>>(
          table, static_cast<T*>(flat), static_cast<const T*>(received), keep_begin, mine_is_a, sums);
    });
    GRADKIT_CUDA_CHECK_LAUNCH();
  }

 private:
  void copy(const ListView& list, void* flat, DType dtype, bool into_flat, Stream stream) {
    cuda::DeviceGuard guard(index_);
    if (list.contiguous != nullptr) {
      const size_t bytes = static_cast<size_t>(list.total) * dtype_size(dtype);
      GRADKIT_CUDA_CHECK(cudaMemcpyAsync(into_flat ? flat : list.contiguous, into_flat ? list.contiguous : flat, bytes,
                                         cudaMemcpyDeviceToDevice, cuda::native(stream)));
      return;
    }
    if (list.num_pieces == 0) return;
    with_native_type(dtype, [&]<class T>() {
      copy_pieces_kernel<T><<<static_cast<unsigned>(list.num_pieces), kThreads, 0, cuda::native(stream)>>>(
          list, static_cast<T*>(flat), into_flat);
    });
    GRADKIT_CUDA_CHECK_LAUNCH();
  }

  int index_;
};

}  // namespace

std::unique_ptr<AdasumDevice> make_cuda_adasum_device(int index) { return std::make_unique<CudaAdasumDevice>(index); }

}  // namespace gradkit::comm::adasum
