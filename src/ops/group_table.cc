#include "gradkit/ops/detail/group_table.h"

#include "spec/cuda_runtime.h"

namespace gradkit::detail {

void write_group_table(std::shared_ptr<void>& device_copy, Device device, const void* host, size_t bytes) {
  if (device_copy) copy_from_host(device_copy.get(), device, host, bytes);
  else device_copy = spec::upload(device, host, bytes);
}

void write_group_table_async(void* device_copy, Device device, const void* host, size_t bytes, Stream stream) {
  spec::copy_from_host_async(device_copy, host, bytes, device, stream);
}

}  // namespace gradkit::detail
