// Every CUDA runtime call is checked; a failure throws with the call and its place.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gradkit/core/device.h"
#include "gradkit/core/error.h"

namespace gradkit::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw Error(ErrorCode::cuda_error, std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                                         cudaGetErrorString(status) + ") at " + file + ":" +
                                         std::to_string(line));
}

// Sets the current device for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

inline cudaStream_t native(Stream s) { return static_cast<cudaStream_t>(s.handle); }

}  // namespace gradkit::cuda

#define GRADKIT_CUDA_CHECK(call)                                                     \
  do {                                                                               \
    const cudaError_t gradkit_status_ = (call);                                      \
    if (gradkit_status_ != cudaSuccess)                                              \
      ::gradkit::cuda::throw_cuda_error(gradkit_status_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: a bad configuration shows up here, not at the launch.
#define GRADKIT_CUDA_CHECK_LAUNCH() GRADKIT_CUDA_CHECK(cudaGetLastError())
