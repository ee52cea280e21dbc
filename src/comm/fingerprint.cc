#include "comm/fingerprint.h"

namespace gradkit::comm {

namespace {

std::string call_name(const Fingerprint& f) {
  static constexpr const char* kNames[] = {"?",          "all_reduce",        "all_gather",           "reduce_scatter",
                                           "all_reduce_buffer", "all_gather_buffer", "reduce_scatter_buffer", "adasum",
                                           "all_gather_buffers", "reduce_scatter_buffers"};
  std::string name = f.kind < std::size(kNames) ? kNames[f.kind] : "?";
  if (f.kind == static_cast<uint32_t>(CallKind::adasum)) {
    return f.reduce == 0 ? name : name + "(hierarchical, " + std::to_string(f.reduce) + " ranks per node)";
  }
  const bool reduces = f.kind == 1 || f.kind == 3 || f.kind == 4 || f.kind == 6 ||
                       f.kind == static_cast<uint32_t>(CallKind::reduce_scatter_buffers);
  if (reduces) name += f.reduce == static_cast<uint32_t>(ReduceOp::average) ? "(average)" : "(sum)";
  return name;
}

}  // namespace

Fingerprint fingerprint_of(CallKind kind, uint32_t variant, std::span<const TensorView> tensors,
                           uint32_t settings) {
  Fingerprint f;
  f.kind = static_cast<uint32_t>(kind);
  f.reduce = variant;
  f.settings = settings;
  f.dtype = tensors.empty() ? 0 : static_cast<uint32_t>(tensors[0].dtype);
  f.count = static_cast<int64_t>(tensors.size());
  // FNV-1a over the element counts: order matters, and a collision between
  // two different lists of the same count and total is vanishingly rare.
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const TensorView& t : tensors) {
    f.total += t.numel;
    auto n = static_cast<uint64_t>(t.numel);
    for (int byte = 0; byte < 8; ++byte, n >>= 8) hash = (hash ^ (n & 0xff)) * 0x100000001b3ull;
  }
  f.sizes_hash = hash;
  return f;
}

std::optional<Mismatch> find_mismatch(std::span<const Fingerprint> all) {
  const Fingerprint& first = all[0];
  for (size_t r = 1; r < all.size(); ++r) {
    const Fingerprint& f = all[r];
    const std::string on_rank = " on rank " + std::to_string(r);
    Mismatch m{static_cast<int>(r), false, {}};
    if (f.kind != first.kind || f.reduce != first.reduce) {
      m.what = "rank 0 calls " + call_name(first) + ", rank " + std::to_string(r) + " calls " + call_name(f);
    } else if (f.count != first.count) {
      m.what = "rank 0 passes " + std::to_string(first.count) + " tensors, rank " + std::to_string(r) + " passes " +
               std::to_string(f.count);
    } else if (f.dtype != first.dtype) {
      m.what = std::string("the dtype is ") + std::string(dtype_name(static_cast<DType>(first.dtype))) +
               " on rank 0 and " + std::string(dtype_name(static_cast<DType>(f.dtype))) + on_rank;
    } else if (f.total != first.total || f.sizes_hash != first.sizes_hash) {
      m.sizes = true;
    } else if (f.settings != first.settings) {
      m.what = "the communicator's settings that decide the collectives of a list all-reduce "
               "(CommunicatorOptions::direct_tensor_bytes, fusion_pipeline_bytes) differ between rank 0 and rank " +
               std::to_string(r);
    } else {
      continue;
    }
    return m;
  }
  return std::nullopt;
}

std::string describe_size_mismatch(std::span<const int64_t> all_counts, size_t stride, int rank) {
  const int64_t* zero = all_counts.data();
  const int64_t* other = all_counts.data() + static_cast<size_t>(rank) * stride;
  for (size_t i = 0; i < stride; ++i) {
    if (zero[i] != other[i]) {
      return "tensor " + std::to_string(i) + " has " + std::to_string(zero[i]) + " elements on rank 0 and " +
             std::to_string(other[i]) + " on rank " + std::to_string(rank);
    }
  }
  return "the element counts differ between rank 0 and rank " + std::to_string(rank);
}

}  // namespace gradkit::comm
