#include "optim/moment_storage.h"

#include <algorithm>

#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/gradient.h"

namespace gradkit {
namespace {

size_t aligned_bytes(const TensorView& param, DType dtype) {
  return (static_cast<size_t>(param.numel) * dtype_size(dtype) + 255) / 256 * 256;
}

size_t region_bytes(const std::vector<TensorView>& params, DType dtype) {
  size_t total = 0;
  for (const TensorView& p : params) total += aligned_bytes(p, dtype);
  return total;
}

size_t total_bytes(const std::vector<TensorView>& tensors) {
  size_t total = 0;
  for (const TensorView& t : tensors) total += t.bytes();
  return total;
}

}  // namespace

Buffer allocate_moments(Device device, const std::vector<TensorView>& params, DType dtype, int count) {
  return Buffer(device, region_bytes(params, dtype) * static_cast<size_t>(count));
}

Buffer allocate_pinned_moments(const std::vector<TensorView>& params, DType dtype, int count) {
  return Buffer::pinned(region_bytes(params, dtype) * static_cast<size_t>(count));
}

std::vector<TensorView> moment_views(const Buffer& buffer, const std::vector<TensorView>& params, DType dtype,
                                     int count, int k) {
  std::vector<TensorView> views;
  if (k >= count) return views;
  size_t offset = region_bytes(params, dtype) * static_cast<size_t>(k);
  for (const TensorView& p : params) {
    views.push_back(buffer.view(dtype, offset, p.numel));
    offset += aligned_bytes(p, dtype);
  }
  return views;
}

Buffer allocate_absmax(Device device, const std::vector<TensorView>& params, std::vector<TensorView>& exp_avg_absmax,
                       std::vector<TensorView>& exp_avg_sq_absmax, int32_t block) {
  std::vector<TensorView> blocks = params;
  for (TensorView& b : blocks) b.numel = (b.numel + block - 1) / block;
  Buffer buffer = allocate_moments(device, blocks, DType::f32, 2);
  exp_avg_absmax = moment_views(buffer, blocks, DType::f32, 2, 0);
  exp_avg_sq_absmax = moment_views(buffer, blocks, DType::f32, 2, 1);
  return buffer;
}

std::vector<TensorView> packed_4bit(std::vector<TensorView> params) {
  for (TensorView& p : params) p.numel = quant4_bytes(p.numel);
  return params;
}

void check_moment_bits(std::string_view op, std::string_view arg, int32_t bits, DType moment) {
  if (bits != 8 && bits != 4) {
    throw_argument_error(ErrorCode::invalid_argument, op, std::string(arg), "is " + std::to_string(bits) +
                                                                             ", expected 8 or 4");
  }
  if (bits == 4 && moment != DType::u8) {
    throw_argument_error(ErrorCode::invalid_argument, op, std::string(arg),
                         "is 4 with moment_dtype " + std::string(dtype_name(moment)) + "; expected u8 moments");
  }
}

std::vector<uint8_t> download(const std::vector<TensorView>& tensors) {
  std::vector<uint8_t> bytes(total_bytes(tensors));
  size_t at = 0;
  for (const TensorView& t : tensors) {
    copy_to_host(bytes.data() + at, t.data, t.bytes(), t.device);
    at += t.bytes();
  }
  return bytes;
}

void upload(const std::vector<uint8_t>& bytes, const std::vector<TensorView>& tensors) {
  size_t at = 0;
  for (const TensorView& t : tensors) {
    copy_from_host(t.data, t.device, bytes.data() + at, t.bytes());
    at += t.bytes();
  }
}

void check_section_size(const std::string& path, const StateFile& file, std::string_view name,
                        const std::vector<TensorView>& tensors) {
  const size_t got = file.get(name).size(), want = total_bytes(tensors);
  if (got != want) {
    throw Error(ErrorCode::io_error, "state file '" + path + "' section '" + std::string(name) + "' has " +
                                         std::to_string(got) + " bytes, expected " + std::to_string(want) +
                                         " for this optimizer's tensors");
  }
}

void check_group_index(std::string_view op, int group, size_t num_groups) {
  if (group < 0 || static_cast<size_t>(group) >= num_groups) {
    throw_argument_error(ErrorCode::invalid_argument, op, "group",
                         "is " + std::to_string(group) + ", expected an index in [0, " + std::to_string(num_groups) + ")");
  }
}

StateFile read_state(const std::string& path, std::string_view kind) {
  StateFile file = StateFile::read(path);
  const std::vector<uint8_t>& bytes = file.get("kind");
  const std::string got(bytes.begin(), bytes.end());
  if (got != kind) {
    // The kind is named only when it looks like one: the message is printed,
    // and the file's bytes may be anything.
    const bool printable =
        got.size() <= 64 && std::all_of(got.begin(), got.end(), [](char c) { return c >= ' ' && c <= '~'; });
    throw Error(ErrorCode::io_error, "state file '" + path + "' holds " +
                                         (printable ? "'" + got + "'" : "an unknown kind of") + " state, expected '" +
                                         std::string(kind) + "'");
  }
  return file;
}

void add_sections(StateFile& file, std::span<const StateSection> sections) {
  for (const StateSection& s : sections) file.add(std::string(s.name), download(*s.tensors));
}

void check_sections(const std::string& path, const StateFile& file, std::span<const StateSection> sections) {
  for (const StateSection& s : sections) check_section_size(path, file, s.name, *s.tensors);
}

void apply_sections(const StateFile& file, std::span<const StateSection> sections) {
  for (const StateSection& s : sections) upload(file.get(s.name), *s.tensors);
}

void cast_into(const std::vector<TensorView>& to, const std::vector<TensorView>& from) {
  AccumulatePlan(to, from).accumulate_v2(Flag::host(true));
  if (!to.empty()) synchronize(to[0].device);
}

std::vector<uint8_t> scaler_section(const LossScaler& scaler) {
  SectionWriter out;
  out.put(scaler.state());
  return out.take();
}

LossScalerState read_scaler_section(const std::string& path, const StateFile& file, const LossScaler& scaler) {
  SectionReader reader(file.get("scaler"), "scaler");
  const auto state = reader.get<LossScalerState>();
  if (!reader.done()) throw Error(ErrorCode::io_error, "state file '" + path + "' section 'scaler' has trailing bytes");
  try {
    scaler.check_state(state);
  } catch (const Error& e) {
    throw Error(ErrorCode::io_error, "state file '" + path + "' has a bad loss scaler state: " + e.what());
  }
  return state;
}

}  // namespace gradkit
