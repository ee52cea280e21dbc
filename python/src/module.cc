// The gradkit Python module: the public C++ API, class for class. Tensors
// cross as DLPack arrays (zero-copy); gradkit::Error becomes ValueError,
// TypeError, RuntimeError or OSError by its code, with the same message.
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "gradkit/core/error.h"

namespace nb = nanobind;

namespace {

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const gradkit::Error& e) {
    using gradkit::ErrorCode;
    PyObject* type = PyExc_RuntimeError;
    switch (e.code()) {
      case ErrorCode::invalid_argument:
      case ErrorCode::size_mismatch:
      case ErrorCode::null_pointer:
      case ErrorCode::aliasing: type = PyExc_ValueError; break;
      case ErrorCode::dtype_unsupported:
      case ErrorCode::device_mismatch: type = PyExc_TypeError; break;
      case ErrorCode::io_error: type = PyExc_OSError; break;
      case ErrorCode::backend_unavailable:
      case ErrorCode::cuda_error:
      case ErrorCode::nccl_error:
      case ErrorCode::mpi_error: type = PyExc_RuntimeError; break;
    }
    PyErr_SetString(type, e.what());
  }
}

}  // namespace

NB_MODULE(_gradkit, m) {
  m.doc() = "gradkit: gradient accumulation, communication, loss scaling and optimizer steps";
  nb::register_exception_translator(translate_error);
  gradkit::python::bind_core(m);
  gradkit::python::bind_ops(m);
  gradkit::python::bind_muon(m);
  gradkit::python::bind_state(m);
  gradkit::python::bind_optim(m);
  gradkit::python::bind_comm(m);
  gradkit::python::bind_offload(m);
}
