// DLPack arrays (nanobind's ndarray: torch, numpy, cupy, jax, ...) as
// gradkit views, and gradkit memory as DLPack arrays. Zero-copy both ways.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradkit/core/tensor.h"

namespace gradkit::python {

namespace nb = nanobind;

using Array = nb::ndarray<>;

// The view of `array`: C-contiguous, f32/f16/bf16/f64, on the CPU or a CUDA
// device. Throws gradkit::Error naming `arg` otherwise.
TensorView to_view(const Array& array, const std::string& arg);

// A list of arrays as views, and the arrays themselves (kept alive by
// whoever made a plan from the views: the plan holds raw pointers).
struct ViewList {
  std::vector<TensorView> views;
  std::vector<Array> arrays;
};
ViewList to_views(const std::vector<Array>& arrays, const std::string& arg);

// A per-step scalar (or a short array: per-group learning rates, per-tensor
// norms) on a device, converted from DLPack once: passing one to a step costs
// a type check, where an array is converted again on every call.
struct DeviceScalar {
  Array array;  // keeps the memory alive
  void* data = nullptr;
  int64_t numel = 0;
  nb::dlpack::dtype dtype{};
  Device device;
};
DeviceScalar make_device_scalar(const Array& array, const std::string& arg);

// The pointer of a per-step scalar argument: None (null), a DeviceScalar or
// a DLPack array. Throws naming `arg` unless it holds exactly `count`
// contiguous elements of `dtype`.
void* scalar_pointer(nb::handle scalar, const std::string& arg, nb::dlpack::dtype dtype, std::string_view dtype_text,
                     int64_t count = 1);
template <class T>
T* scalar_pointer(nb::handle scalar, const std::string& arg, std::string_view dtype_text, int64_t count = 1) {
  return static_cast<T*>(scalar_pointer(scalar, arg, nb::dtype<T>(), dtype_text, count));
}

// A flag: bool, or uint8 holding 0 or 1 (for frameworks whose DLPack export
// has no bool, e.g. PyTorch before 2.0: pass flag.view(torch.uint8)).
bool* flag_pointer(nb::handle flag, const std::string& arg, int64_t count = 1);

// The device of a per-step scalar argument (a DeviceScalar or an array).
Device scalar_device(nb::handle scalar, const std::string& arg);

// gradkit memory as a 1-D DLPack array of `view.numel` elements; `owner`
// (the Python object owning that memory) stays alive as long as the array.
nb::object to_array(const TensorView& view, nb::handle owner);
nb::list to_arrays(std::span<const TensorView> views, nb::handle owner);

// An object whose memory Python sees as arrays (a GradientArena, a
// LossScaler), shared by its Python object and those arrays: an array's
// owner is a capsule holding a share, not the Python object. A torch tensor
// made from an array (a parameter's .grad or .data, a scale saved by an
// autograd graph) can outlive every Python reference to the object, held by
// torch's C++; and torch (2.11, not 1.13) never frees a tensor whose last
// C++ owner lets go while the interpreter is finalizing. What such a tensor
// then keeps is the memory, not a Python object that would outlive the
// module (docs/python.md, "At exit").
template <class T>
struct Shared {
  std::shared_ptr<T> object;

  nb::object memory_owner() const {
    return nb::capsule(new std::shared_ptr<T>(object), "gradkit memory",
                       [](void* share) noexcept { delete static_cast<std::shared_ptr<T>*>(share); });
  }
};

// The CUDA stream handle a Python caller passes: an int (cudaStream_t), 0
// for the legacy default stream.
inline Stream to_stream(uintptr_t handle) { return Stream{reinterpret_cast<void*>(handle)}; }

}  // namespace gradkit::python
