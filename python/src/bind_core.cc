#include <nanobind/stl/string.h>

#include "bindings.h"
#include "gradkit/core/device.h"
#include "gradkit/core/dtype.h"
#include "gradkit/core/memory.h"
#include "tensors.h"

namespace gradkit::python {

void bind_core(nb::module_& m) {
  nb::enum_<DType>(m, "DType", "Element types: f32, f16, bf16 (round to nearest even), f64; u8 (8-bit moments) "
                               "and i16 (remainder masters) for encoded optimizer state.")
      .value("f32", DType::f32)
      .value("f16", DType::f16)
      .value("bf16", DType::bf16)
      .value("f64", DType::f64)
      .value("u8", DType::u8)
      .value("i16", DType::i16);

  nb::class_<DeviceScalar>(m, "DeviceScalar",
                           "A per-step scalar (loss scale, found-inf flag, step counter, learning rates) converted "
                           "from a DLPack array once, so that passing it to a step costs no conversion. The array's "
                           "memory stays alive with it.")
      .def("__init__", [](DeviceScalar* s, const Array& a) { new (s) DeviceScalar(make_device_scalar(a, "array")); },
           nb::arg("array"))
      .def_prop_ro("numel", [](const DeviceScalar& s) { return s.numel; })
      .def_prop_ro("device", [](const DeviceScalar& s) { return to_string(s.device); });

  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices usable by gradkit (0 without a driver, a GPU, or a CUDA build).");
  m.def(
      "synchronize", [](const std::string& device) { synchronize(parse_device(device)); }, nb::arg("device"),
      "Waits until all work queued on `device` ('cpu', 'cuda' or 'cuda:N') has finished.");
  m.def(
      "view_info",
      [](const Array& array) {
        const TensorView v = to_view(array, "array");
        return nb::make_tuple(reinterpret_cast<uintptr_t>(v.data), v.numel, v.dtype, to_string(v.device));
      },
      nb::arg("array"),
      "(data pointer, elements, DType, device) of the gradkit view of a DLPack array; raises as every "
      "gradkit call does for an array it cannot take.");
}

}  // namespace gradkit::python
