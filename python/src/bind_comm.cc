// The communication layer's pieces that need no communicator to make: the
// gradient arena (its all-reduce arrives with the communicator bindings).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings.h"
#include "gradkit/core/error.h"
#include "tensors.h"

#if GRADKIT_WITH_MPI
#include "gradkit/comm/gradient_arena.h"
#endif

namespace gradkit::python {

void bind_comm(nb::module_& m) {
#if GRADKIT_WITH_MPI
  nb::class_<GradientArena>(m, "GradientArena",
                            "A model's gradients as views into one zero-filled allocation, each starting on an "
                            "`alignment`-byte boundary.")
      .def(
          "__init__",
          [](GradientArena* a, const std::string& device, DType dtype, const std::vector<int64_t>& numels,
             size_t alignment) { new (a) GradientArena(parse_device(device), dtype, numels, alignment); },
          nb::arg("device"), nb::arg("dtype"), nb::arg("numels"), nb::arg("alignment") = 256)
      .def("__len__", &GradientArena::size)
      .def("gradients", [](nb::handle self) { return to_arrays(nb::cast<GradientArena&>(self).gradients(), self); },
           "Each gradient as a 1-D array (zero-copy; the arena stays alive while an array does).")
      .def("flat", [](nb::handle self) { return to_array(nb::cast<GradientArena&>(self).flat(), self); },
           "The whole arena, gaps included, as one 1-D array.")
      .def_prop_ro("dtype", &GradientArena::dtype)
      .def_prop_ro("device", [](const GradientArena& a) { return to_string(a.device()); });
#else
  (void)m;
#endif
}

}  // namespace gradkit::python
