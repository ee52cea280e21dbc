// Validation and layout of the tensor lists the collectives take: one dtype,
// one device, no nulls, no forbidden overlap; and whether a list lies back to
// back in one allocation, so that one collective can cover it in place.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "comm/layout_cache.h"
#include "gradkit/core/tensor.h"

namespace gradkit::comm {

struct ListInfo {
  DType dtype = DType::f32;
  int64_t total = 0;          // elements over the whole list
  bool contiguous = false;    // every non-empty tensor starts where the previous one ended
  unsigned char* base = nullptr;  // the first non-empty tensor's data (when contiguous)
};

// Checks each tensor of `tensors` (named `arg` in errors): on `device`, its
// memory really there, non-negative count, non-null data when non-empty, all
// one dtype. Returns the list's dtype, total and layout.
ListInfo inspect_list(std::string_view op, std::string_view arg, std::span<const TensorView> tensors,
                      Device device);

// outputs[i] must have the element count and dtype of inputs[i], and the
// lists the same length.
void check_matching(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs);

// True when outputs[i] is inputs[i] (same data, count, dtype) for every i.
bool same_tensors(std::span<const TensorView> inputs, std::span<const TensorView> outputs);

// Written tensors may not overlap each other; when `inputs` is not empty,
// no output may overlap any input either.
void check_no_overlap(std::string_view op, std::span<const TensorView> outputs, std::span<const TensorView> inputs);

struct ListPair {
  ListInfo in, out;
};

// The checks every list collective makes on its (inputs, outputs): each list
// inspected (in place: one list, named "tensors"), sizes and dtypes
// matching, no forbidden overlap.
ListPair inspect_lists(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                       Device device);

// Remembers the last few (inputs, outputs) pairs that passed
// inspect_lists, so that a training loop that passes the same lists every
// step pays one comparison of its views instead of a CUDA pointer query per
// tensor: the host cost of a repeated call does not grow with CUDA calls
// per tensor. A view equal in every field (pointer, count, dtype, device) to
// one checked before is taken as checked.
class ListCheckCache {
 public:
  ListPair inspect(std::string_view op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                   Device device);

 private:
  struct Entry {
    std::vector<TensorView> inputs, outputs;
    ListPair result;
  };
  static constexpr size_t kEntries = kLayoutsKept;
  std::vector<Entry> entries_;  // most recent first
};

// Visits the pieces of the list's elements [begin, end) of its
// concatenation: piece(tensor, offset in the tensor, offset in the
// concatenation, count), in order.
template <class Piece>
void for_each_piece(std::span<const TensorView> tensors, int64_t begin, int64_t end, Piece&& piece) {
  int64_t offset = 0;
  for (const TensorView& t : tensors) {
    const int64_t first = std::max(begin, offset);
    const int64_t last = std::min(end, offset + t.numel);
    if (first < last) piece(t, first - offset, first, last - first);
    offset += t.numel;
    if (offset >= end) break;
  }
}

}  // namespace gradkit::comm
