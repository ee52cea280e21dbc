// A list of tensors planned once, launched many times at O(1) host cost.
//
// An operation over N parallel lists (say buffers and values) validates them
// once here: equal list lengths, equal element counts tensor by tensor, one
// dtype per list, one device for everything, no null data with a non-zero
// count, no overlap between a written tensor and any other tensor (except the
// identical tensor at the same index of a read-only list, for in-place use),
// no storage dtype (u8, i16) outside a list that declares it. It then cuts every
// tensor into chunks of at most `chunk_elements` and, for CUDA, uploads the
// chunk table and the pointer table to the device. A launch afterwards passes
// one pointer to the kernel, whatever the number of tensors, and can be
// captured in a CUDA graph. The plan keeps the data pointers it was made
// from: the memory must stay where it is for as long as the plan is used.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradkit/core/tensor.h"

namespace gradkit {

struct PlanList {
  std::string_view name;                // the argument name errors report
  std::span<const TensorView> tensors;
  bool written = false;                 // does the operation write this list?
  // A list of per-block values (the absmax of 8-bit moments): each of its
  // tensors holds one element per `block` elements of the first list's
  // tensor at its index (ceil(numel / block) elements), and a chunk's part
  // of it starts at chunk.begin / block. The plan's chunk size must then be
  // a multiple of `block`, so that no block straddles two chunks.
  int32_t block = 1;
  bool storage = false;                 // may the list hold a storage dtype (u8, i16)?
};

// One chunk: elements [begin, begin + length) of tensor `tensor`.
struct PlanChunk {
  int64_t begin;
  int32_t tensor;
  int32_t length;
};

class MultiTensorPlan {
 public:
  // 64K elements: large enough that a chunk's fixed cost (reading its entry
  // and its pointers) is negligible, small enough that a list of small
  // tensors still yields thousands of independent blocks.
  static constexpr int64_t kDefaultChunkElements = 65536;

  MultiTensorPlan() = default;
  // Validates as described above, naming `op` and the list names in errors.
  // `groups`, if not empty, gives each tensor's parameter-group index (one per
  // tensor, each in [0, num_groups)); kernels read it to find the group's
  // hyperparameters, so that all groups run in one launch.
  MultiTensorPlan(std::string_view op, std::span<const PlanList> lists,
                  int64_t chunk_elements = kDefaultChunkElements,
                  std::span<const int32_t> groups = {}, int32_t num_groups = 1);

  // A default-constructed plan is an empty plan on the CPU.
  bool empty() const { return !impl_ || impl_->chunks.empty(); }
  Device device() const { return impl_ ? impl_->device : Device::cpu(); }
  int num_lists() const { return impl_ ? static_cast<int>(impl_->dtypes.size()) : 0; }
  size_t num_tensors() const { return impl_ ? impl_->num_tensors : 0; }
  DType dtype(int list) const { return impl_->dtypes.at(static_cast<size_t>(list)); }
  int64_t total_elements() const { return impl_ ? impl_->total_elements : 0; }
  int64_t chunk_elements() const { return impl_ ? impl_->chunk_elements : kDefaultChunkElements; }

  // Host copies of the tables: chunks in tensor order; pointers list-major
  // (tensor t of list l at pointers()[l * num_tensors() + t]).
  std::span<const PlanChunk> chunks() const { return impl_ ? std::span<const PlanChunk>(impl_->chunks) : std::span<const PlanChunk>(); }
  std::span<void* const> pointers() const { return impl_ ? std::span<void* const>(impl_->pointers) : std::span<void* const>(); }
  std::span<const int64_t> numels() const { return impl_ ? std::span<const int64_t>(impl_->numels) : std::span<const int64_t>(); }
  std::span<const int32_t> groups() const { return impl_ ? std::span<const int32_t>(impl_->groups) : std::span<const int32_t>(); }
  int32_t block(int list) const { return impl_->blocks.at(static_cast<size_t>(list)); }

  // The device copy (chunks, then pointers, then groups) for CUDA plans; null for CPU.
  const void* device_table() const { return impl_ ? impl_->device_table.get() : nullptr; }

  // Points list `list` at `tensors` instead, for callers whose tensors move
  // between launches (a framework that allocates new gradients each step).
  // `tensors` must match the list's element counts, dtype and device; the
  // constructor's checks are made for them (overlaps against every other
  // list included) and nothing changes if one fails. The chunk table stays;
  // a CUDA plan's pointer table is rewritten in place by a copy enqueued on
  // `stream` (no synchronization): launches enqueued on `stream` before it
  // read the old pointers, launches after it the new ones, and a captured
  // CUDA graph, which keeps the table's address, sees the new ones too. So
  // re-point on the stream the plan launches on. Copies of a plan share its
  // tables, and so the change.
  void repoint(int list, std::span<const TensorView> tensors, Stream stream = {});

 private:
  struct Impl {
    Device device = Device::cpu();
    size_t num_tensors = 0;
    int64_t total_elements = 0;
    int64_t chunk_elements = kDefaultChunkElements;
    std::vector<DType> dtypes;
    std::vector<PlanChunk> chunks;
    std::vector<void*> pointers;
    std::vector<int64_t> numels;
    std::vector<int32_t> groups;
    std::string op;                  // the operation named in errors
    std::vector<std::string> names;  // each list's argument name
    std::vector<bool> written;       // each list's written flag
    std::vector<int32_t> blocks;     // each list's PlanList::block
    std::vector<bool> storage;       // each list's PlanList::storage
    std::shared_ptr<void> device_table;  // freed with the last copy of the plan
  };
  static void upload_tables(Impl& impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace gradkit
