// Owned memory on a device, for the owning layers (optimizers, arenas) and
// for users who want gradkit to hold a buffer; ops themselves take views.
#pragma once

#include <cstddef>
#include <memory>

#include "gradkit/core/tensor.h"

namespace gradkit {

class Buffer {
 public:
  Buffer() = default;
  // `bytes` of zero-filled memory on `device`, aligned to 256 bytes and
  // rounded up to whole 256-byte blocks: NCCL's LL protocols read whole 4-
  // and 16-byte words, past the end of an odd-sized f16 buffer (bytes()
  // still reports what was asked for). A side effect: memcheck does not
  // see an over-read that stays inside the padding.
  Buffer(Device device, size_t bytes);
  // `bytes` of zero-filled page-locked host memory (device cpu), laid out
  // as above, for asynchronous copies to and from a GPU. Needs CUDA and a
  // visible device: otherwise, or when the allocation fails, throws Error
  // naming the size and the reason (nothing is allocated).
  static Buffer pinned(size_t bytes);

  void* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool is_pinned() const { return pinned_; }
  // A view of `numel` elements of `dtype` starting `byte_offset` bytes in.
  TensorView view(DType dtype, size_t byte_offset, int64_t numel) const;

 private:
  std::shared_ptr<void> data_;
  size_t bytes_ = 0;
  Device device_ = Device::cpu();
  bool pinned_ = false;
};

// Synchronous copies between host memory and memory on `device` (a plain
// memcpy when `device` is the CPU).
void copy_to_host(void* host_destination, const void* source, size_t bytes, Device source_device);
void copy_from_host(void* destination, Device destination_device, const void* host_source, size_t bytes);

// Waits until all work queued on the device (every stream) has finished.
void synchronize(Device device);

}  // namespace gradkit
