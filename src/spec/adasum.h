// The arithmetic of Adasum on one kind of memory: loops on the host
// (cpu/adasum.cc) or CUDA kernels (cuda/adasum.cu). The plan (adasum_plan.cc)
// moves the data between ranks and calls these in between; every pointer
// here is memory of the device (tables included, uploaded once by the plan).
//
// Element arithmetic is f32 (f64 for f64 data), rounded once to the dtype;
// dot products and squared norms are accumulated in f64, piece by piece in a
// fixed order and then per tensor in piece order, so that a result is
// bitwise the same from run to run.
#pragma once

#include <cstdint>
#include <memory>

#include "comm/adasum/schedule.h"
#include "gradkit/core/device.h"
#include "gradkit/core/dtype.h"

namespace gradkit::comm::adasum {

// One step's piece table as the device sees it, and scratch for one
// (a·b, |a|², |b|²) triple per piece.
struct TableView {
  const Piece* pieces = nullptr;
  int64_t num_pieces = 0;
  const int32_t* first_piece = nullptr;  // num_slots + 1 entries
  int32_t num_slots = 0;                 // the tensors, and the padding
  double* piece_sums = nullptr;          // 3 * num_pieces
};

// The tensors of the list and where each lies in the flat vector.
struct ListView {
  const Piece* pieces = nullptr;  // of [0, total): the tensors' elements, no padding
  int64_t num_pieces = 0;
  void* const* pointers = nullptr;      // tensor t's data
  const int64_t* tensor_begin = nullptr;  // tensor t's offset in the flat vector
  void* contiguous = nullptr;           // the first tensor's data when the list lies back to back
  int64_t total = 0;
};

class AdasumDevice {
 public:
  virtual ~AdasumDevice() = default;

  // The list's concatenation into `flat`, and back.
  virtual void pack(const ListView& list, void* flat, DType dtype, Stream stream) = 0;
  virtual void unpack(const ListView& list, const void* flat, DType dtype, Stream stream) = 0;

  // mine[i] = mine[i] + theirs[i], rounded once (the sum inside a node).
  virtual void add(void* mine, const void* theirs, int64_t count, DType dtype, Stream stream) = 0;

  // For each slot of `table` (3 doubles per slot in `sums`): a·b, |a|², |b|²
  // over the table's pieces, where this rank's values are flat[i] and the
  // peer's are received[i - keep_begin], and `a` is this rank's when mine_is_a.
  virtual void partial_sums(const TableView& table, const void* flat, const void* received, int64_t keep_begin,
                            bool mine_is_a, DType dtype, double* sums, Stream stream) = 0;

  // sums[i] = theirs[i] + sums[i] when theirs_first, else sums[i] + theirs[i]:
  // the lower group's sums always come first, so that every rank of a group
  // adds in the same order and gets bitwise the same total.
  virtual void add_sums(double* sums, const double* theirs, int64_t count, bool theirs_first, Stream stream) = 0;

  // flat[i] = ca * a + cb * b over the table's pieces, with each slot's
  // coefficients from its (a·b, |a|², |b|²) in `sums` (see spec/adasum_math.h).
  virtual void combine(const TableView& table, void* flat, const void* received, int64_t keep_begin, bool mine_is_a,
                       DType dtype, const double* sums, Stream stream) = 0;
};

std::unique_ptr<AdasumDevice> make_cpu_adasum_device();
// Throws backend_unavailable in a build without CUDA and NCCL.
std::unique_ptr<AdasumDevice> make_cuda_adasum_device(int index);

}  // namespace gradkit::comm::adasum
