// The communication layer: communicators (MPI, NCCL from MPI or from a
// unique id), their list collectives, the gradient arena and Adasum. A
// build without MPI has all but the MPI pieces (create_mpi_communicator,
// create_nccl_communicator_mpi, MpiEnvironment), which it leaves out;
// has_mpi_communicator() says which build this is.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "bindings.h"
#include "gradkit/core/error.h"
#include "tensors.h"

#include "gradkit/comm/adasum.h"
#include "gradkit/comm/communicator.h"
#include "gradkit/comm/gradient_arena.h"

namespace gradkit::python {

namespace {

using Arrays = std::vector<Array>;

#if GRADKIT_WITH_MPI
// MPI for the lifetime of the object (nothing if MPI is already initialized,
// e.g. by mpi4py); close() finalizes what it started.
struct PyMpiEnvironment {
  std::unique_ptr<MpiEnvironment> env = std::make_unique<MpiEnvironment>(nullptr, nullptr);
  void close() { env.reset(); }
};
#endif

// An Adasum plan and the arrays it points into; the communicator is kept
// alive by nanobind (keep_alive) for as long as the plan.
struct PyAdasumPlan {
  ViewList tensors;
  AdasumPlan plan;
  PyAdasumPlan(Communicator& comm, const Arrays& t, const AdasumOptions& options)
      : tensors(to_views(t, "tensors")), plan(comm, tensors.views, options) {}
};

NcclUniqueId to_unique_id(const nb::bytes& bytes) {
  NcclUniqueId id;
  if (bytes.size() != id.bytes.size()) {
    throw_argument_error(ErrorCode::invalid_argument, "create_nccl_communicator", "unique_id",
                         "has " + std::to_string(bytes.size()) + " bytes, expected " +
                             std::to_string(id.bytes.size()) + " (from nccl_unique_id())");
  }
  std::memcpy(id.bytes.data(), bytes.c_str(), id.bytes.size());
  return id;
}

// The out-of-place form when `outputs` is given, in place otherwise.
template <class InPlace, class OutOfPlace>
void in_or_out(const Arrays& tensors, const std::optional<Arrays>& outputs, InPlace&& in_place,
               OutOfPlace&& out_of_place) {
  const ViewList in = to_views(tensors, "tensors");
  if (outputs) out_of_place(in.views, to_views(*outputs, "outputs").views);
  else in_place(in.views);
}

void bind_communicator(nb::module_& m) {
  nb::enum_<ReduceOp>(m, "ReduceOp").value("sum", ReduceOp::sum).value("average", ReduceOp::average);

  nb::class_<CommunicatorOptions>(m, "CommunicatorOptions", "docs/ops.md, Collectives: what each option does.")
      .def(
          "__init__",
          [](CommunicatorOptions* o, double timeout_s, bool checked, int cuda_device, size_t fusion_pipeline_bytes,
             size_t direct_tensor_bytes, bool blocking_calls) {
            new (o) CommunicatorOptions();
            o->timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
            o->checked = checked;
            o->cuda_device = cuda_device;
            o->fusion_pipeline_bytes = fusion_pipeline_bytes;
            o->direct_tensor_bytes = direct_tensor_bytes;
            o->blocking_calls = blocking_calls;
          },
          nb::arg("timeout_s") = 600.0, nb::arg("checked") = false, nb::arg("cuda_device") = -1,
          nb::arg("fusion_pipeline_bytes") = CommunicatorOptions{}.fusion_pipeline_bytes,
          nb::arg("direct_tensor_bytes") = CommunicatorOptions{}.direct_tensor_bytes,
          nb::arg("blocking_calls") = CommunicatorOptions{}.blocking_calls)
      .def_prop_rw(
          "timeout_s", [](const CommunicatorOptions& o) { return o.timeout.count() / 1000.0; },
          [](CommunicatorOptions& o, double s) { o.timeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0)); })
      .def_rw("checked", &CommunicatorOptions::checked)
      .def_rw("cuda_device", &CommunicatorOptions::cuda_device)
      .def_rw("fusion_pipeline_bytes", &CommunicatorOptions::fusion_pipeline_bytes)
      .def_rw("direct_tensor_bytes", &CommunicatorOptions::direct_tensor_bytes)
      .def_rw("blocking_calls", &CommunicatorOptions::blocking_calls);

  nb::class_<Communicator>(m, "Communicator",
                           "The ranks of a data-parallel job (MPI: host memory; NCCL: this rank's GPU, work "
                           "enqueued on `stream`). Every rank makes the same calls in the same order.")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_ro("local_rank", &Communicator::local_rank)
      .def_prop_ro("local_size", &Communicator::local_size)
      .def_prop_ro("device", [](const Communicator& c) { return to_string(c.device()); })
      .def_prop_ro("backend", [](const Communicator& c) { return std::string(c.backend_name()); })
      .def_prop_ro("timeout_s", [](const Communicator& c) { return c.timeout().count() / 1000.0; })
      .def_prop_rw("checked", &Communicator::checked, &Communicator::set_checked)
      .def_prop_ro("fusion_buffer_bytes", &Communicator::fusion_buffer_bytes)
      .def(
          "all_reduce",
          [](Communicator& c, const Arrays& tensors, ReduceOp op, const std::optional<Arrays>& outputs,
             uintptr_t stream) {
            in_or_out(
                tensors, outputs, [&](auto in) { c.all_reduce(in, op, to_stream(stream)); },
                [&](auto in, auto out) { c.all_reduce(in, out, op, to_stream(stream)); });
          },
          nb::arg("tensors"), nb::arg("op") = ReduceOp::sum, nb::arg("outputs") = nb::none(), nb::arg("stream") = 0,
          "Every element becomes the sum (or average) over ranks; into `outputs` when given.")
      .def(
          "all_gather",
          [](Communicator& c, const Arrays& tensors, const std::optional<Arrays>& outputs, uintptr_t stream) {
            in_or_out(
                tensors, outputs, [&](auto in) { c.all_gather(in, to_stream(stream)); },
                [&](auto in, auto out) { c.all_gather(in, out, to_stream(stream)); });
          },
          nb::arg("tensors"), nb::arg("outputs") = nb::none(), nb::arg("stream") = 0,
          "Each element becomes the value its owning rank holds (ShardLayout of the list's concatenation).")
      .def(
          "reduce_scatter",
          [](Communicator& c, const Arrays& tensors, ReduceOp op, const std::optional<Arrays>& outputs,
             uintptr_t stream) {
            in_or_out(
                tensors, outputs, [&](auto in) { c.reduce_scatter(in, op, to_stream(stream)); },
                [&](auto in, auto out) { c.reduce_scatter(in, out, op, to_stream(stream)); });
          },
          nb::arg("tensors"), nb::arg("op") = ReduceOp::sum, nb::arg("outputs") = nb::none(), nb::arg("stream") = 0,
          "This rank's shard of the list's concatenation becomes the sum (or average) over ranks.")
      .def("barrier", &Communicator::barrier, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "wait", [](Communicator& c, uintptr_t stream) { c.wait(to_stream(stream)); }, nb::arg("stream") = 0,
          nb::call_guard<nb::gil_scoped_release>(),
          "Returns when this communicator's work on `stream` has finished; throws after the timeout or when a "
          "peer failed (the communicator is then aborted).");

  m.def("has_nccl_communicator", &has_nccl_communicator);
  m.def("has_mpi_communicator", &has_mpi_communicator,
        "Whether this build has MPI: create_mpi_communicator, create_nccl_communicator_mpi and MpiEnvironment.");
#if GRADKIT_WITH_MPI
  m.def(
      "create_mpi_communicator", [](const CommunicatorOptions& o) { return create_mpi_communicator(o); },
      nb::arg("options") = CommunicatorOptions{}, nb::call_guard<nb::gil_scoped_release>(),
      "An MPI communicator over MPI_COMM_WORLD (MPI must be initialized: MpiEnvironment or mpi4py).");
  m.def(
      "create_nccl_communicator_mpi", [](const CommunicatorOptions& o) { return create_nccl_communicator(o); },
      nb::arg("options") = CommunicatorOptions{}, nb::call_guard<nb::gil_scoped_release>(),
      "An NCCL communicator over MPI_COMM_WORLD's ranks, bootstrapped through MPI.");
#endif
  m.def(
      "nccl_unique_id",
      []() {
        const NcclUniqueId id = create_nccl_unique_id();
        return nb::bytes(reinterpret_cast<const char*>(id.bytes.data()), id.bytes.size());
      },
      "A new NCCL unique id (bytes) for create_nccl_communicator: made by one rank, shared with the others.");
  m.def(
      "create_nccl_communicator",
      [](const nb::bytes& unique_id, int rank, int size, const CommunicatorOptions& o) {
        const NcclUniqueId id = to_unique_id(unique_id);
        nb::gil_scoped_release release;  // every rank blocks here until all have joined (or the timeout)
        return create_nccl_communicator(id, rank, size, o);
      },
      nb::arg("unique_id"), nb::arg("rank"), nb::arg("size"), nb::arg("options") = CommunicatorOptions{},
      "An NCCL communicator without MPI: this process is `rank` of `size`, every rank passing the same id.");

#if GRADKIT_WITH_MPI
  nb::class_<PyMpiEnvironment>(m, "MpiEnvironment",
                               "Initializes MPI unless it already is; close() (or leaving a `with` block) "
                               "finalizes what it started. Destroy the communicators first.")
      .def(nb::init<>())
      .def("close", &PyMpiEnvironment::close)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyMpiEnvironment& e, nb::args) { e.close(); });
#endif
}

using PyGradientArena = Shared<GradientArena>;  // arrays keep the memory, not the object

void bind_arena_and_adasum(nb::module_& m) {
  nb::class_<PyGradientArena>(m, "GradientArena",
                              "A model's gradients as views into one zero-filled allocation, each starting on an "
                              "`alignment`-byte boundary.")
      .def(
          "__init__",
          [](PyGradientArena* a, const std::string& device, DType dtype, const std::vector<int64_t>& numels,
             size_t alignment) {
            new (a) PyGradientArena{std::make_shared<GradientArena>(parse_device(device), dtype, numels, alignment)};
          },
          nb::arg("device"), nb::arg("dtype"), nb::arg("numels"), nb::arg("alignment") = 256)
      .def(
          "__init__",
          [](PyGradientArena* a, const std::string& device, DType dtype, const ShardedLayout& layout) {
            new (a) PyGradientArena{std::make_shared<GradientArena>(parse_device(device), dtype, layout)};
          },
          nb::arg("device"), nb::arg("dtype"), nb::arg("layout"),
          "The tensors of a ShardedLayout at its offsets, padding included (a sharded model's weights or gradients).")
      .def("__len__", [](const PyGradientArena& a) { return a.object->size(); })
      .def("buffer",
           [](const PyGradientArena& a) {
             const GradientArena& g = *a.object;
             const auto elements = static_cast<int64_t>(g.buffer().bytes() / dtype_size(g.dtype()));
             return to_array(g.buffer().view(g.dtype(), 0, elements), a.memory_owner());
           },
           "The whole allocation, padding included, as one 1-D array.")
      .def("gradients", [](const PyGradientArena& a) { return to_arrays(a.object->gradients(), a.memory_owner()); },
           "Each gradient as a 1-D array (zero-copy; the memory stays alive while an array does).")
      .def("flat", [](const PyGradientArena& a) { return to_array(a.object->flat(), a.memory_owner()); },
           "The whole arena, gaps included, as one 1-D array.")
      .def(
          "all_reduce",
          [](const PyGradientArena& a, Communicator& comm, ReduceOp op, uintptr_t stream) {
            a.object->all_reduce(comm, op, to_stream(stream));
          },
          nb::arg("comm"), nb::arg("op") = ReduceOp::sum, nb::arg("stream") = 0,
          "One collective over the whole arena (gaps included).")
      .def_prop_ro("dtype", [](const PyGradientArena& a) { return a.object->dtype(); })
      .def_prop_ro("device", [](const PyGradientArena& a) { return to_string(a.object->device()); });

  nb::class_<AdasumOptions>(m, "AdasumOptions")
      .def(
          "__init__",
          [](AdasumOptions* o, bool hierarchical, int ranks_per_node) {
            new (o) AdasumOptions{hierarchical, ranks_per_node};
          },
          nb::arg("hierarchical") = false, nb::arg("ranks_per_node") = 0)
      .def_rw("hierarchical", &AdasumOptions::hierarchical)
      .def_rw("ranks_per_node", &AdasumOptions::ranks_per_node);

  nb::class_<PyAdasumPlan>(m, "AdasumPlan",
                           "Adasum over ranks of a tensor list, in place, planned once (docs/ops.md, Adasum).")
      .def(nb::init<Communicator&, const Arrays&, const AdasumOptions&>(), nb::arg("comm"), nb::arg("tensors"),
           nb::arg("options") = AdasumOptions{}, nb::keep_alive<1, 2>())
      .def(
          "run", [](PyAdasumPlan& p, uintptr_t stream) { p.plan.run(to_stream(stream)); }, nb::arg("stream") = 0,
          "Every tensor becomes the Adasum over ranks (NCCL: enqueued on `stream`).")
      .def_prop_ro("bytes_sent", [](const PyAdasumPlan& p) { return p.plan.bytes_sent(); });
}

}  // namespace

void bind_comm(nb::module_& m) {
  bind_communicator(m);
  bind_arena_and_adasum(m);
}

}  // namespace gradkit::python
