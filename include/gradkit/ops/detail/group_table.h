// The per-group hyperparameters an optimizer plan keeps: a host copy, and
// for CUDA plans a device copy that kernels index by group. The device copy
// is written in place once it exists, so a CUDA graph captured earlier keeps
// a valid pointer and sees the new values.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"

namespace gradkit::detail {

// Copies `bytes` from host memory into the table's device allocation (made
// on first use); defined in src/ops/group_table.cc.
void write_group_table(std::shared_ptr<void>& device_copy, Device device, const void* host, size_t bytes);
// The same enqueued on `stream` (the allocation exists), without waiting for
// the device: kernels enqueued after it on that stream read the new values.
void write_group_table_async(void* device_copy, Device device, const void* host, size_t bytes, Stream stream);

template <class Hyperparameters>
class GroupTable {
 public:
  // Validates every entry (validate(h, op, "hyperparameters[i]") throws
  // naming the field), and checks the group count against the table's once
  // it has one; then stores them. Nothing changes if anything throws.
  void set(std::string_view op, std::span<const Hyperparameters> entries, Device device) {
    if (!host_.empty() && entries.size() != host_.size()) {
      throw_argument_error(ErrorCode::size_mismatch, op, "hyperparameters",
                           "has " + std::to_string(entries.size()) + " groups, expected " + std::to_string(host_.size()));
    }
    for (size_t i = 0; i < entries.size(); ++i) validate(entries[i], op, "hyperparameters[" + std::to_string(i) + "]");
    host_.assign(entries.begin(), entries.end());
    if (device.is_cuda()) write_group_table(device_, device, host_.data(), host_.size() * sizeof(Hyperparameters));
  }

  // As set(), with the device copy written in order on `stream` rather than
  // synchronously (once the table exists): for per-step changes (a learning
  // rate schedule) that must not stall the device.
  void set_on(std::string_view op, std::span<const Hyperparameters> entries, Device device, Stream stream) {
    if (!device.is_cuda() || !device_ || entries.size() != host_.size()) return set(op, entries, device);
    for (size_t i = 0; i < entries.size(); ++i) validate(entries[i], op, "hyperparameters[" + std::to_string(i) + "]");
    host_.assign(entries.begin(), entries.end());
    write_group_table_async(device_.get(), device, host_.data(), host_.size() * sizeof(Hyperparameters), stream);
  }

  bool empty() const { return host_.empty(); }
  std::span<const Hyperparameters> host() const { return host_; }
  // The table the kernels of `device` read.
  const Hyperparameters* on(Device device) const {
    return device.is_cuda() ? static_cast<const Hyperparameters*>(device_.get()) : host_.data();
  }

 private:
  std::vector<Hyperparameters> host_;
  std::shared_ptr<void> device_;
};

}  // namespace gradkit::detail
