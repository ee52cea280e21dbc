#include "gradkit/core/multi_tensor_plan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "spec/cuda_runtime.h"
#include "gradkit/core/error.h"

namespace gradkit {
namespace {

// Beyond this, element counts times element sizes could overflow 64 bits.
constexpr int64_t kMaxElements = int64_t{1} << 60;

std::string element_name(std::string_view list, size_t index) {
  return std::string(list) + "[" + std::to_string(index) + "]";
}

// The element count list entry i must have: the first list's count, or one
// per `block` of it.
int64_t expected_numel(int64_t first_numel, int32_t block) { return (first_numel + block - 1) / block; }

// The checks every tensor of a plan passes: its element count (that of the
// first list's tensor at its index, or one per block of it), its list's
// dtype (a storage dtype only where the list takes one), the plan's device,
// a pointer that is not null and is aligned, memory that the device can reach.
void check_tensor(std::string_view op, std::string_view list, size_t i, const TensorView& t, int64_t expected,
                  std::string_view first_list, DType dtype, Device device, bool storage) {
  if (t.numel < 0 || t.numel > kMaxElements) {
    throw_argument_error(ErrorCode::invalid_argument, op, element_name(list, i),
                         "has " + std::to_string(t.numel) + " elements, expected a count from 0 to 2^60");
  }
  if (is_storage_dtype(t.dtype) && !storage) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, element_name(list, i),
                         "has dtype " + std::string(dtype_name(t.dtype)) +
                             ", expected f32, f16, bf16 or f64 (this list holds no encoded state)");
  }
  if (t.numel != expected) {
    throw_argument_error(ErrorCode::size_mismatch, op, element_name(list, i),
                         "has " + std::to_string(t.numel) + " elements, expected " + std::to_string(expected) +
                             " (from the size of " + element_name(first_list, i) + ")");
  }
  if (t.dtype != dtype) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, element_name(list, i),
                         "has dtype " + std::string(dtype_name(t.dtype)) + ", expected " +
                             std::string(dtype_name(dtype)) + " (one dtype per list, that of " +
                             element_name(list, 0) + ")");
  }
  if (t.device != device) {
    throw_argument_error(ErrorCode::device_mismatch, op, element_name(list, i),
                         "is on " + to_string(t.device) + ", expected " + to_string(device) + " (the device of " +
                             element_name(first_list, 0) + ")");
  }
  if (t.data == nullptr && t.numel > 0) {
    throw_argument_error(ErrorCode::null_pointer, op, element_name(list, i),
                         "is null with " + std::to_string(t.numel) + " elements; expected a valid pointer");
  }
  if (t.numel > 0 && reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, element_name(list, i),
                         "starts at an address that is not a multiple of its " +
                             std::to_string(dtype_size(t.dtype)) + "-byte elements; expected aligned data");
  }
  if (t.numel > 0) spec::check_memory_location(op, list, i, t);
}

// A tensor's byte range, for the overlap check.
struct Extent {
  uintptr_t begin, end;
  int list;
  size_t index;
  bool written;
};

// A written tensor may share memory only with the identical tensor at the
// same index of a list that is only read (in-place use, e.g. buffer +=
// buffer); any other overlap would make the result depend on the order in
// which blocks run, or write two results to one place.
void check_overlaps(std::string_view op, std::span<const PlanList> lists) {
  std::vector<Extent> extents;
  for (int l = 0; l < static_cast<int>(lists.size()); ++l) {
    for (size_t i = 0; i < lists[l].tensors.size(); ++i) {
      const TensorView& t = lists[l].tensors[i];
      if (t.numel == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(t.data);
      extents.push_back({begin, begin + t.bytes(), l, i, lists[l].written});
    }
  }
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (size_t a = 0; a < extents.size(); ++a) {
    for (size_t b = a + 1; b < extents.size() && extents[b].begin < extents[a].end; ++b) {
      const Extent& x = extents[a];
      const Extent& y = extents[b];
      if (!x.written && !y.written) continue;
      const bool identical = x.begin == y.begin && x.end == y.end && x.index == y.index && x.list != y.list &&
                             !(x.written && y.written);
      if (identical) continue;
      const Extent& w = x.written ? x : y;
      const Extent& o = x.written ? y : x;
      throw_argument_error(ErrorCode::aliasing, op, element_name(lists[w.list].name, w.index),
                           "overlaps '" + element_name(lists[o.list].name, o.index) + "'" +
                               "; expected disjoint memory (or, for a list that is only read, the identical tensor at the same index)");
    }
  }
}

}  // namespace

// The device copy of a CUDA plan's tables: chunks, then pointers, then groups.
void MultiTensorPlan::upload_tables(Impl& impl) {
  if (!impl.device.is_cuda() || impl.chunks.empty()) return;
  const size_t chunk_bytes = impl.chunks.size() * sizeof(PlanChunk);
  const size_t pointer_bytes = impl.pointers.size() * sizeof(void*);
  const size_t group_bytes = impl.groups.size() * sizeof(int32_t);
  std::vector<unsigned char> table(chunk_bytes + pointer_bytes + group_bytes);
  std::memcpy(table.data(), impl.chunks.data(), chunk_bytes);
  std::memcpy(table.data() + chunk_bytes, impl.pointers.data(), pointer_bytes);
  std::memcpy(table.data() + chunk_bytes + pointer_bytes, impl.groups.data(), group_bytes);
  impl.device_table = spec::upload(impl.device, table.data(), table.size());
}

MultiTensorPlan::MultiTensorPlan(std::string_view op, std::span<const PlanList> lists,
                                 int64_t chunk_elements, std::span<const int32_t> groups,
                                 int32_t num_groups) {
  if (lists.empty()) {
    throw Error(ErrorCode::invalid_argument, std::string(op) + ": no tensor lists given");
  }
  if (chunk_elements <= 0 || chunk_elements > (int64_t{1} << 30) || chunk_elements % 8 != 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "chunk_elements",
                         "is " + std::to_string(chunk_elements) +
                             ", expected a positive multiple of 8 up to 2^30");
  }
  const PlanList& first = lists[0];
  const size_t n = first.tensors.size();
  auto impl = std::make_shared<Impl>();
  impl->num_tensors = n;
  impl->chunk_elements = chunk_elements;
  impl->device = n > 0 ? first.tensors[0].device : Device::cpu();

  for (const PlanList& list : lists) {
    if (list.tensors.size() != n) {
      throw_argument_error(ErrorCode::size_mismatch, op, list.name,
                           "has " + std::to_string(list.tensors.size()) + " tensors, expected " +
                               std::to_string(n) + " (the length of '" + std::string(first.name) + "')");
    }
    impl->dtypes.push_back(n > 0 ? list.tensors[0].dtype : DType::f32);
  }

  impl->numels.resize(n);
  impl->pointers.resize(n * lists.size());
  for (size_t l = 0; l < lists.size(); ++l) {
    const PlanList& list = lists[l];
    if (list.block < 1 || chunk_elements % list.block != 0) {
      throw_argument_error(ErrorCode::invalid_argument, op, std::string(list.name) + " block",
                           "is " + std::to_string(list.block) + ", expected a divisor of chunk_elements (" +
                               std::to_string(chunk_elements) + ")");
    }
    impl->names.emplace_back(list.name);
    impl->written.push_back(list.written);
    impl->blocks.push_back(list.block);
    impl->storage.push_back(list.storage);
    for (size_t i = 0; i < n; ++i) {
      check_tensor(op, list.name, i, list.tensors[i], expected_numel(first.tensors[i].numel, list.block), first.name,
                   impl->dtypes[l], impl->device, list.storage);
      impl->pointers[l * n + i] = list.tensors[i].data;
    }
  }
  check_overlaps(op, lists);

  if (!groups.empty() && groups.size() != n) {
    throw_argument_error(ErrorCode::size_mismatch, op, "groups",
                         "has " + std::to_string(groups.size()) + " entries, expected one per tensor (" +
                             std::to_string(n) + ")");
  }
  impl->groups.assign(n, 0);
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i] < 0 || groups[i] >= num_groups) {
      throw_argument_error(ErrorCode::invalid_argument, op, "groups[" + std::to_string(i) + "]",
                           "is " + std::to_string(groups[i]) + ", expected a group index in [0, " +
                               std::to_string(num_groups) + ")");
    }
    impl->groups[i] = groups[i];
  }

  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = first.tensors[i].numel;
    impl->numels[i] = numel;
    impl->total_elements += numel;
    if (i > static_cast<size_t>(INT32_MAX)) {
      throw_argument_error(ErrorCode::invalid_argument, op, first.name,
                           "has more than 2^31 - 1 tensors; expected fewer");
    }
    for (int64_t begin = 0; begin < numel; begin += chunk_elements) {
      impl->chunks.push_back(
          {begin, static_cast<int32_t>(i), static_cast<int32_t>(std::min(chunk_elements, numel - begin))});
    }
  }

  impl->op = op;
  upload_tables(*impl);
  impl_ = std::move(impl);
}

void MultiTensorPlan::repoint(int list, std::span<const TensorView> tensors, Stream stream) {
  if (!impl_) throw Error(ErrorCode::invalid_argument, "repoint: the plan is empty (default-constructed)");
  Impl& old = *impl_;
  const std::string_view op = old.op;
  if (list < 0 || list >= num_lists()) {
    throw_argument_error(ErrorCode::invalid_argument, op, "list",
                         "is " + std::to_string(list) + ", expected a list index in [0, " +
                             std::to_string(num_lists()) + ")");
  }
  const size_t n = old.num_tensors;
  const std::string_view name = old.names[static_cast<size_t>(list)];
  if (tensors.size() != n) {
    throw_argument_error(ErrorCode::size_mismatch, op, name,
                         "has " + std::to_string(tensors.size()) + " tensors, expected " + std::to_string(n) +
                             " (the plan's)");
  }
  const DType dtype = n > 0 ? old.dtypes[static_cast<size_t>(list)] : DType::f32;
  const int32_t block = old.blocks[static_cast<size_t>(list)];
  for (size_t i = 0; i < n; ++i) {
    check_tensor(op, name, i, tensors[i], expected_numel(old.numels[i], block), old.names[0], dtype, old.device,
                 old.storage[static_cast<size_t>(list)]);
  }

  // The overlap check sees every list, the kept ones rebuilt from the tables.
  std::vector<std::vector<TensorView>> kept(old.names.size());
  std::vector<PlanList> lists;
  for (size_t l = 0; l < old.names.size(); ++l) {
    if (static_cast<int>(l) == list) {
      lists.push_back({old.names[l], tensors, old.written[l]});
      continue;
    }
    for (size_t i = 0; i < n; ++i) {
      kept[l].push_back({old.pointers[l * n + i], expected_numel(old.numels[i], old.blocks[l]), old.dtypes[l], old.device});
    }
    lists.push_back({old.names[l], kept[l], old.written[l], old.blocks[l], old.storage[l]});
  }
  check_overlaps(op, lists);

  void** pointers = old.pointers.data() + static_cast<size_t>(list) * n;
  for (size_t i = 0; i < n; ++i) pointers[i] = tensors[i].data;
  if (old.device_table) {
    // The list's pointers sit after the chunk table, list-major.
    auto* table = static_cast<unsigned char*>(old.device_table.get()) + old.chunks.size() * sizeof(PlanChunk) +
                  static_cast<size_t>(list) * n * sizeof(void*);
    spec::copy_from_host_async(table, pointers, n * sizeof(void*), old.device, stream);
  }
}

}  // namespace gradkit
