// Non-owning views of memory: the type every operation takes.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "gradkit/core/device.h"
#include "gradkit/core/dtype.h"

namespace gradkit {

// A contiguous run of `numel` elements of type `dtype` at `data` on `device`.
// gradkit never frees or keeps the memory beyond what an operation documents
// (a plan keeps the pointers it was made from).
struct TensorView {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::f32;
  Device device = Device::cpu();

  size_t bytes() const { return static_cast<size_t>(numel) * dtype_size(dtype); }
  template <class T> T* as() const { return static_cast<T*>(data); }
};

template <class T>
TensorView view(T* data, int64_t numel, Device device = Device::cpu()) {
  return TensorView{const_cast<std::remove_const_t<T>*>(data), numel, dtype_of_v<std::remove_const_t<T>>, device};
}

using TensorList = std::vector<TensorView>;

// A flag that an operation reads (do_update, overwrite) or writes (updated).
// It lives either on the host, read or written when the call is made, or in
// device memory (a `bool` on the op's device), read or written by the kernel,
// so that the whole step can be captured in a CUDA graph and replayed.
struct Flag {
  enum class Where { none, host, device };
  Where where = Where::none;
  bool host_value = true;   // for Where::host on inputs
  bool* pointer = nullptr;  // for Where::device, or for a host output flag

  static Flag none() { return {}; }
  static Flag host(bool v) { return {Where::host, v, nullptr}; }
  static Flag host_output(bool* p) { return {Where::host, false, p}; }
  static Flag device(bool* p) { return {Where::device, true, p}; }
};

}  // namespace gradkit
