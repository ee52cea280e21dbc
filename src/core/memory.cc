#include "gradkit/core/memory.h"

#include <cstring>
#include <string>

#include "spec/cuda_runtime.h"
#include "core/host_memory.h"
#include "core/pinned.h"
#include "gradkit/core/error.h"

namespace gradkit {

namespace {

// Every allocation is a whole number of 256-byte blocks (one at least),
// zero-filled to its end, while bytes() stays what was asked for. Engines
// read the aligned word or block holding a tensor's last element: NCCL's
// LL protocol loads 4-byte words (an odd count of f16 reads 2 bytes past
// the end), LL128 16-byte blocks (docs/ops.md, "Allocate whole 16-byte
// blocks"). Were a fusion buffer, arena or working copy to end exactly at
// its last element, memcheck would report those reads. cudaMalloc
// aligns every allocation to 256 bytes, so the padding costs nothing there.
constexpr size_t kAllocationUnit = 256;

size_t allocation_bytes(size_t bytes) {
  const size_t blocks = bytes / kAllocationUnit + (bytes % kAllocationUnit != 0 ? 1 : 0);
  return (blocks == 0 ? 1 : blocks) * kAllocationUnit;
}

}  // namespace

Buffer::Buffer(Device device, size_t bytes) : bytes_(bytes), device_(device) {
  const size_t rounded = allocation_bytes(bytes);
  if (rounded < bytes) throw Error(ErrorCode::invalid_argument, "Buffer: cannot allocate " + std::to_string(bytes) + " bytes");
  if (device.is_cuda()) {
    data_ = spec::allocate(device, rounded);
    return;
  }
  data_ = detail::allocate_host(rounded);  // zero-filled, a large one by every core (host_memory.h)
  if (!data_) throw Error(ErrorCode::invalid_argument, "Buffer: cannot allocate " + std::to_string(bytes) + " bytes");
}

Buffer Buffer::pinned(size_t bytes) {
  const size_t rounded = allocation_bytes(bytes);
  if (rounded < bytes) throw Error(ErrorCode::invalid_argument, "Buffer::pinned: cannot allocate " + std::to_string(bytes) + " bytes");
  Buffer out;
  out.data_ = detail::allocate_registered(rounded);
  out.bytes_ = bytes;
  out.pinned_ = true;
  return out;
}

TensorView Buffer::view(DType dtype, size_t byte_offset, int64_t numel) const {
  if (numel < 0 || byte_offset > bytes_ || static_cast<size_t>(numel) > (bytes_ - byte_offset) / dtype_size(dtype)) {
    throw_argument_error(ErrorCode::invalid_argument, "Buffer::view", "numel",
                         "is " + std::to_string(numel) + " at byte offset " + std::to_string(byte_offset) +
                             ", expected the view to fit in the buffer's " + std::to_string(bytes_) + " bytes");
  }
  return TensorView{static_cast<unsigned char*>(data_.get()) + byte_offset, numel, dtype, device_};
}

void copy_to_host(void* host_destination, const void* source, size_t bytes, Device source_device) {
  if (source_device.is_cuda()) spec::copy_to_host(host_destination, source, bytes, source_device);
  else if (bytes > 0) std::memcpy(host_destination, source, bytes);
}

void copy_from_host(void* destination, Device destination_device, const void* host_source, size_t bytes) {
  if (destination_device.is_cuda()) spec::copy_from_host(destination, host_source, bytes, destination_device);
  else if (bytes > 0) std::memcpy(destination, host_source, bytes);
}

void synchronize(Device device) {
  if (device.is_cuda()) spec::synchronize(device);
}

}  // namespace gradkit
