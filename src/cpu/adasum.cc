// Adasum's arithmetic on host memory: the loops the CUDA kernels mirror.
// Single-threaded on purpose: the MPI path is bound by the network, and
// one thread keeps the f64 sums in one fixed order without further care.
#include <cstring>
#include <type_traits>

#include "spec/adasum.h"
#include "spec/adasum_math.h"

namespace gradkit::comm::adasum {

namespace {

// The type element arithmetic is done in: f32, or f64 for f64 data.
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
compute_t<T> load(const void* base, int64_t i) {
  return static_cast<compute_t<T>>(static_cast<const T*>(base)[i]);
}

class CpuAdasumDevice final : public AdasumDevice {
 public:
  void pack(const ListView& list, void* flat, DType dtype, Stream) override {
    copy_pieces(list, flat, dtype, true);
  }

  void unpack(const ListView& list, const void* flat, DType dtype, Stream) override {
    copy_pieces(list, const_cast<void*>(flat), dtype, false);
  }

  void add(void* mine, const void* theirs, int64_t count, DType dtype, Stream) override {
    dispatch_dtype(dtype, [&]<class T>() {
      auto* out = static_cast<T*>(mine);
      for (int64_t i = 0; i < count; ++i) out[i] = T(load<T>(mine, i) + load<T>(theirs, i));
    });
  }

  void partial_sums(const TableView& table, const void* flat, const void* received, int64_t keep_begin,
                    bool mine_is_a, DType dtype, double* sums, Stream) override {
    dispatch_dtype(dtype, [&]<class T>() {
      const T* mine = static_cast<const T*>(flat);
      const T* theirs = static_cast<const T*>(received);  // theirs[i - keep_begin] pairs with mine[i]
      // Each piece summed on its own, then the pieces of a tensor in order:
      // the same grouping as the kernels, one piece per block.
      for (int64_t p = 0; p < table.num_pieces; ++p) {
        const Piece& piece = table.pieces[p];
        double dot = 0, norm_mine = 0, norm_theirs = 0;
        for (int64_t i = piece.begin; i < piece.begin + piece.length; ++i) {
          const auto m = static_cast<double>(static_cast<compute_t<T>>(mine[i]));
          const auto t = static_cast<double>(static_cast<compute_t<T>>(theirs[i - keep_begin]));
          dot += m * t;
          norm_mine += m * m;
          norm_theirs += t * t;
        }
        double* out = table.piece_sums + 3 * p;
        out[0] = dot;
        out[1] = mine_is_a ? norm_mine : norm_theirs;
        out[2] = mine_is_a ? norm_theirs : norm_mine;
      }
    });
    for (int32_t slot = 0; slot < table.num_slots; ++slot) {
      double total[3] = {0, 0, 0};
      for (int32_t p = table.first_piece[slot]; p < table.first_piece[slot + 1]; ++p) {
        for (int k = 0; k < 3; ++k) total[k] += table.piece_sums[3 * p + k];
      }
      std::memcpy(sums + 3 * slot, total, sizeof(total));
    }
  }

  void add_sums(double* sums, const double* theirs, int64_t count, bool theirs_first, Stream) override {
    for (int64_t i = 0; i < count; ++i) sums[i] = theirs_first ? theirs[i] + sums[i] : sums[i] + theirs[i];
  }

  void combine(const TableView& table, void* flat, const void* received, int64_t keep_begin, bool mine_is_a,
               DType dtype, const double* sums, Stream) override {
    dispatch_dtype(dtype, [&]<class T>() {
      using C = compute_t<T>;
      T* mine = static_cast<T*>(flat);
      const T* theirs = static_cast<const T*>(received);  // theirs[i - keep_begin] pairs with mine[i]
      for (int64_t p = 0; p < table.num_pieces; ++p) {
        const Piece& piece = table.pieces[p];
        const double* s = sums + 3 * piece.tensor;
        const Coefficients c = coefficients(s[0], s[1], s[2]);
        const auto ca = static_cast<C>(c.a), cb = static_cast<C>(c.b);
        for (int64_t i = piece.begin; i < piece.begin + piece.length; ++i) {
          const auto m = static_cast<C>(mine[i]), t = static_cast<C>(theirs[i - keep_begin]);
          const C a = mine_is_a ? m : t, b = mine_is_a ? t : m;
          mine[i] = T(ca * a + cb * b);
        }
      }
    });
  }

 private:
  static void copy_pieces(const ListView& list, void* flat, DType dtype, bool into_flat) {
    const size_t size = dtype_size(dtype);
    auto* vector = static_cast<unsigned char*>(flat);
    if (list.contiguous != nullptr) {
      const size_t bytes = static_cast<size_t>(list.total) * size;
      if (into_flat) std::memcpy(vector, list.contiguous, bytes);
      else std::memcpy(list.contiguous, vector, bytes);
      return;
    }
    for (int64_t p = 0; p < list.num_pieces; ++p) {
      const Piece& piece = list.pieces[p];
      auto* tensor = static_cast<unsigned char*>(list.pointers[piece.tensor]) +
                     static_cast<size_t>(piece.begin - list.tensor_begin[piece.tensor]) * size;
      unsigned char* at = vector + static_cast<size_t>(piece.begin) * size;
      const size_t bytes = static_cast<size_t>(piece.length) * size;
      if (into_flat) std::memcpy(at, tensor, bytes);
      else std::memcpy(tensor, at, bytes);
    }
  }
};

}  // namespace

std::unique_ptr<AdasumDevice> make_cpu_adasum_device() { return std::make_unique<CpuAdasumDevice>(); }

}  // namespace gradkit::comm::adasum
