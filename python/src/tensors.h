// DLPack arrays (nanobind's ndarray: torch, numpy, cupy, jax, ...) as
// gradkit views, and gradkit memory as DLPack arrays. Zero-copy both ways.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

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

// The pointer of an optional per-step scalar array (None: null), e.g. a
// learning rate or a found-inf flag on the device. Throws naming `arg` unless
// it holds exactly `count` contiguous elements of `dtype`.
void* scalar_pointer(const std::optional<Array>& array, const std::string& arg, nb::dlpack::dtype dtype,
                     std::string_view dtype_text, int64_t count = 1);
template <class T>
T* scalar_pointer(const std::optional<Array>& array, const std::string& arg, std::string_view dtype_text,
                  int64_t count = 1) {
  return static_cast<T*>(scalar_pointer(array, arg, nb::dtype<T>(), dtype_text, count));
}

// A flag: bool, or uint8 holding 0 or 1 (for frameworks whose DLPack export
// has no bool, e.g. PyTorch before 2.0: pass flag.view(torch.uint8)).
bool* flag_pointer(const std::optional<Array>& array, const std::string& arg, int64_t count = 1);

// The device an array lives on (CPU or CUDA); throws naming nothing else.
Device to_view_device(const Array& array);

// gradkit memory as a 1-D DLPack array of `view.numel` elements; `owner`
// (the Python object owning that memory) stays alive as long as the array.
nb::object to_array(const TensorView& view, nb::handle owner);
nb::list to_arrays(std::span<const TensorView> views, nb::handle owner);

// The CUDA stream handle a Python caller passes: an int (cudaStream_t), 0
// for the legacy default stream.
inline Stream to_stream(uintptr_t handle) { return Stream{reinterpret_cast<void*>(handle)}; }

}  // namespace gradkit::python
