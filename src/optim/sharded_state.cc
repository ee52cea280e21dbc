// Sharded<Adam or Lamb>'s state files: rank 0 gathers every rank's pieces
// into the unsharded optimizer's format, and a load cuts that format into
// each rank's pieces (sharded.cc: making it and its step).
#include "gradkit/optim/sharded.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "gradkit/core/error.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/optim/state_file.h"
#include "optim/hyperparameter_io.h"
#include "optim/moment_storage.h"
#include "optim/sharded_parts.h"

namespace gradkit {
namespace {

constexpr std::string_view kOp = detail::kShardedOp;
template <class Optimizer>
using Traits = detail::ShardedTraits<Optimizer>;

// A dtype whose elements have `bytes` bytes, to move raw state elements.
DType dtype_of_size(size_t bytes) {
  return bytes == 8 ? DType::f64 : bytes == 4 ? DType::f32 : DType::bf16;
}

// A state section split like the weights: its name, the bytes of one
// stored value, and the elements each stands for (1; 2 for 4-bit codes, two
// a byte; kQuantBlock or kQuant4Block for the absmax of 8- or 4-bit
// moments, one per block).
struct SplitSection {
  std::string_view name;
  size_t width;
  int64_t unit;
};

// The optimizer's split sections, in the order the unsharded one writes them.
template <class Optimizer>
std::vector<SplitSection> split_sections(const Optimizer& o) {
  const bool quantized = !o.exp_avg_absmax().empty();
  const int32_t bits = cut_bits(o);
  std::vector<SplitSection> out;
  for (std::string_view name : Traits<Optimizer>::sections) {
    out.push_back({name, dtype_size(o.exp_avg()[0].dtype), quantized ? elements_per_code_byte(bits) : 1});
  }
  if (quantized) {
    out.push_back({"exp_avg_absmax", sizeof(float), quant_block_of(bits)});
    out.push_back({"exp_avg_sq_absmax", sizeof(float), quant_block_of(bits)});
  }
  return out;
}

int64_t stored(int64_t elements, int64_t unit) { return (elements + unit - 1) / unit; }

// Each tensor's first stored value in a section of the unsharded file
// (tensors back to back in group order, which is the layout's order; `unit`
// elements per value).
std::vector<int64_t> section_offsets(const ShardedLayout& layout, int64_t unit) {
  std::vector<int64_t> at(layout.numels.size() + 1, 0);
  for (size_t t = 0; t < layout.numels.size(); ++t) at[t + 1] = at[t] + stored(layout.numels[t], unit);
  return at;
}

}  // namespace

template <class Optimizer>
void Sharded<Optimizer>::agree(bool ok, const std::string& what) {
  Buffer flag(comm_.device(), sizeof(double));
  const double mine = ok ? 0.0 : 1.0;
  copy_from_host(flag.data(), comm_.device(), &mine, sizeof mine);
  const TensorView view{flag.data(), 1, DType::f64, comm_.device()};
  comm_.all_reduce_buffer(view, view, ReduceOp::sum);
  comm_.wait();
  double failed = 0;
  copy_to_host(&failed, flag.data(), sizeof failed, comm_.device());
  if (failed == 0) return;
  throw Error(ErrorCode::io_error, ok ? std::string(kOp) + ": " + std::to_string(static_cast<int>(failed)) +
                                            " other rank(s) failed; see their error"
                                      : what);
}

template <class Optimizer>
void Sharded<Optimizer>::save_to(StateFile& file) {
  comm_.wait();
  synchronize(comm_.device());
  // This rank's state, its pieces back to back, as its optimizers write it
  // (their sections concatenated in bucket order, the pieces' order).
  std::vector<StateFile> parts(parts_.size());
  for (size_t k = 0; k < parts_.size(); ++k) parts_[k].optimizer->save_to(parts[k]);
  const std::vector<SplitSection> sections = split_sections(*parts_[0].optimizer);
  StateFile mine;
  for (const SplitSection& section : sections) {
    std::vector<uint8_t> bytes;
    for (const StateFile& part : parts) {
      bytes.insert(bytes.end(), part.get(section.name).begin(), part.get(section.name).end());
    }
    mine.add(std::string(section.name), std::move(bytes));
  }
  mine.add("meta", parts[0].get("meta"));      // the same step count on every part
  mine.add("groups", parts[0].get("groups"));  // the hyperparameters (with its pieces' shapes)
  Buffer joined;
  const std::vector<TensorView> f32_masters = masters_.f32(joined, true);
  const StateSection master_section[] = {{"masters", &f32_masters}};
  if (mixed_) add_sections(mine, master_section);

  const bool root = comm_.rank() == 0;
  int64_t max_slice = 0;
  for (const ShardedLayout::Bucket& b : layout_.buckets) max_slice = std::max(max_slice, b.slice);
  // Every rank's pieces into the unsharded layout on rank 0, bucket by
  // bucket through one device buffer of a bucket's size. A section of
  // per-block values (unit > 1) is cut at the same places, divided by the
  // unit: the layout's slices and offsets are multiples of it then
  // (check_blocks_line_up).
  auto gather = [&](const SplitSection& section) {
    const size_t width = section.width;
    const int64_t unit = section.unit;
    const std::vector<int64_t> at = section_offsets(layout_, unit);
    const std::vector<uint8_t>& part = mine.get(section.name);
    std::vector<uint8_t> full(root ? static_cast<size_t>(at.back()) * width : 0);
    const int64_t max_values = stored(max_slice, unit) * layout_.world_size;
    Buffer staging(comm_.device(), static_cast<size_t>(max_values) * width);
    // The collectives move f16/bf16/f32/f64 elements: u8 codes go as 4-byte
    // words (their slices are multiples of kQuantBlock elements, a multiple of 4 bytes of 8- or 4-bit codes:
    // check_blocks_line_up).
    const size_t word = width == 1 ? 4 : width;
    const TensorView staged{staging.data(), max_values, dtype_of_size(word), comm_.device()};
    std::vector<uint8_t> host(static_cast<size_t>(max_values) * width);
    size_t from = 0;  // the next piece's bytes in `part`
    size_t next = 0;  // the next piece
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      const ShardedLayout::Bucket& bucket = layout_.buckets[b];
      const int64_t slice = stored(bucket.slice, unit);
      std::fill(host.begin(), host.end(), 0);
      for (; next < pieces_.size() && pieces_[next].bucket == b; ++next) {
        const size_t n = static_cast<size_t>(stored(pieces_[next].count, unit)) * width;
        std::memcpy(host.data() + static_cast<size_t>(pieces_[next].in_slice / unit) * width, part.data() + from, n);
        from += n;
      }
      const size_t slice_bytes = static_cast<size_t>(slice) * width;
      auto* device_slice = static_cast<unsigned char*>(staging.data()) + slice_bytes * static_cast<size_t>(comm_.rank());
      copy_from_host(device_slice, comm_.device(), host.data(), slice_bytes);
      const auto words = static_cast<int64_t>(slice_bytes / word);
      comm_.all_gather_buffer(TensorView{device_slice, words, staged.dtype, staged.device},
                              TensorView{staging.data(), words * layout_.world_size, staged.dtype, staged.device});
      comm_.wait();
      if (!root) continue;
      copy_to_host(host.data(), staging.data(), slice_bytes * static_cast<size_t>(layout_.world_size), comm_.device());
      for (size_t t = bucket.first; t < bucket.last; ++t) {
        std::memcpy(full.data() + static_cast<size_t>(at[t]) * width,
                    host.data() + static_cast<size_t>((layout_.offsets[t] - bucket.begin) / unit) * width,
                    static_cast<size_t>(stored(layout_.numels[t], unit)) * width);
      }
    }
    return full;
  };

  // The sections in the order the unsharded optimizer writes them, so that
  // the files are the same byte for byte.
  for (const SplitSection& section : sections) {
    const bool kept = Traits<Optimizer>::keeps(*parts_[0].optimizer, section.name);
    file.add(std::string(section.name), kept ? gather(section) : std::vector<uint8_t>());
  }
  std::vector<uint8_t> masters = mixed_ ? gather({"masters", sizeof(float), 1}) : std::vector<uint8_t>();
  if (!root) return;
  file.add("meta", mine.get("meta"));
  file.add("groups", write_groups(model_shapes_, read_groups(kOp, "", mine.get("groups"), shard_shapes_[0])));
  if (mixed_) file.add("masters", std::move(masters));
  if (mixed_ || scaler_.options().mode != LossScaling::none) file.add("scaler", scaler_section(scaler_));
}

template <class Optimizer>
void Sharded<Optimizer>::save(const std::string& path) {
  StateFile file;
  const std::string_view kind = mixed_ ? Traits<Optimizer>::mixed_kind : Traits<Optimizer>::kind;
  file.add("kind", std::vector<uint8_t>(kind.begin(), kind.end()));
  save_to(file);
  std::string error;
  if (comm_.rank() == 0) {
    try {
      file.write(path);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree(error.empty(), error);
}

template <class Optimizer>
typename Sharded<Optimizer>::ShardState Sharded<Optimizer>::shard_state(const std::string& path,
                                                                        const StateFile& file) const {
  // The file checked against the whole model, then cut to this rank's
  // pieces as a state file for each of its optimizers, which check the rest.
  ShardState shard;
  const auto hyper = read_groups(kOp, path, file.get("groups"), model_shapes_);
  auto cut = [&](const SplitSection& section, size_t first, size_t last) {
    const std::vector<int64_t> at = section_offsets(layout_, section.unit);
    const size_t width = section.width;
    const std::vector<uint8_t>& full = file.get(section.name);
    std::vector<uint8_t> part;
    if (full.empty() && section.name == "max_exp_avg_sq") return part;  // checked by Adam against its groups
    if (full.size() != static_cast<size_t>(at.back()) * width) {
      throw Error(ErrorCode::io_error, "state file '" + path + "' section '" + std::string(section.name) + "' has " +
                                           std::to_string(full.size()) + " bytes, expected " +
                                           std::to_string(static_cast<size_t>(at.back()) * width));
    }
    for (size_t k = first; k < last && k < pieces_.size(); ++k) {
      const ShardedLayout::Piece& p = pieces_[k];
      const auto* from = full.data() + static_cast<size_t>(at[p.tensor] + p.offset / section.unit) * width;
      part.insert(part.end(), from, from + static_cast<size_t>(stored(p.count, section.unit)) * width);
    }
    return part;
  };
  const std::vector<SplitSection> sections = split_sections(*parts_[0].optimizer);
  for (size_t k = 0; k < parts_.size(); ++k) {
    StateFile state;
    for (const SplitSection& section : sections) {
      state.add(std::string(section.name), cut(section, parts_[k].first, parts_[k].last));
    }
    state.add("meta", file.get("meta"));
    state.add("groups", write_groups(shard_shapes_[k], hyper));
    parts_[k].optimizer->check_state(path, state);
    shard.optimizers.push_back(std::move(state));
  }
  if (mixed_) {
    shard.rest.add("masters", cut({"masters", sizeof(float), 1}, 0, pieces_.size()));
    const std::vector<TensorView> shapes = masters_.file_shapes();
    const StateSection masters[] = {{"masters", &shapes}};
    check_sections(path, shard.rest, masters);
  }
  if (file.has("scaler")) {
    read_scaler_section(path, file, scaler_);
    shard.rest.add("scaler", file.get("scaler"));
  } else if (mixed_) {
    file.get("scaler");  // throws, naming the section
  }
  return shard;
}

template <class Optimizer>
void Sharded<Optimizer>::check_state(const std::string& path, const StateFile& file) const { shard_state(path, file); }

template <class Optimizer>
void Sharded<Optimizer>::apply_state(const StateFile& file) {
  const ShardState shard = shard_state("", file);
  for (size_t k = 0; k < parts_.size(); ++k) parts_[k].optimizer->apply_state(shard.optimizers[k]);
  if (shard.rest.has("scaler")) scaler_.set_state(read_scaler_section("", shard.rest, scaler_));
  if (mixed_) {
    Buffer loaded;
    const std::vector<TensorView> f32 = masters_.f32(loaded, false);
    const StateSection masters[] = {{"masters", &f32}};
    apply_sections(shard.rest, masters);
    // The model's weights (and remainders) from the loaded masters, on every rank.
    masters_.masters_written(f32);
    gather_weights({});
    comm_.wait();
  }
}

template <class Optimizer>
void Sharded<Optimizer>::load(const std::string& path) {
  StateFile file;
  std::string error;
  try {
    file = read_state(path, mixed_ ? Traits<Optimizer>::mixed_kind : Traits<Optimizer>::kind);
    check_state(path, file);
  } catch (const Error& e) {
    error = e.what();
  }
  agree(error.empty(), error);
  apply_state(file);
}

template void Sharded<Adam>::save_to(StateFile&);
template void Sharded<Lamb>::save_to(StateFile&);
template void Sharded<Adam>::save(const std::string&);
template void Sharded<Lamb>::save(const std::string&);
template void Sharded<Adam>::check_state(const std::string&, const StateFile&) const;
template void Sharded<Lamb>::check_state(const std::string&, const StateFile&) const;
template void Sharded<Adam>::apply_state(const StateFile&);
template void Sharded<Lamb>::apply_state(const StateFile&);
template void Sharded<Adam>::load(const std::string&);
template void Sharded<Lamb>::load(const std::string&);

}  // namespace gradkit
