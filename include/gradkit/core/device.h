// Where memory lives and where work runs.
#pragma once

#include <string>

namespace gradkit {

enum class DeviceType { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // the CUDA ordinal; 0 for the CPU

  static constexpr Device cpu() { return {DeviceType::cpu, 0}; }
  static constexpr Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  constexpr bool is_cuda() const { return type == DeviceType::cuda; }
  friend constexpr bool operator==(Device, Device) = default;
};

// "cpu" or "cuda:N".
std::string to_string(Device d);
// Parses "cpu", "cuda" (= cuda:0) or "cuda:N"; throws Error naming `arg` otherwise.
Device parse_device(const std::string& text, const char* arg = "device");

// The CUDA stream an operation is enqueued on, as an opaque handle so that
// gradkit's headers do not need cuda_runtime.h. A cudaStream_t converts to it
// with Stream{s}; the default (null) is CUDA's legacy default stream. CPU
// operations ignore it and run synchronously on the calling thread.
struct Stream {
  void* handle = nullptr;
};

// Number of CUDA devices usable by this process: 0 if gradkit was built
// without CUDA, if no driver is loaded, or if no GPU is visible.
int cuda_device_count();

}  // namespace gradkit
