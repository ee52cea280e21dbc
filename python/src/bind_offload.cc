// OffloadedAdam and OffloadedLamb: the optimizer with its state in host
// memory and its step on the CPU, driven bucket by bucket
// (gradkit/optim/offloaded.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <vector>

#include "bindings.h"
#include "groups.h"
#include "gradkit/optim/offloaded.h"
#include "tensors.h"

namespace gradkit::python {
namespace {

// The options both take; `moment_dtype` and `moment_bits` are the host moments' form.
OffloadedOptions offload_options(DType moment_dtype, std::optional<std::vector<int32_t>> buckets, size_t bucket_bytes,
                                 size_t piece_bytes, const std::optional<LossScalerOptions>& scaler, float max_norm,
                                 NormType norm, int host_threads, bool release, int32_t moment_bits) {
  OffloadedOptions options;
  options.adam.moment_dtype = options.lamb.moment_dtype = moment_dtype;
  options.adam.moment_bits = options.lamb.moment_bits = moment_bits;
  options.buckets = buckets.value_or(std::vector<int32_t>{});
  options.bucket_bytes = bucket_bytes;
  options.piece_bytes = piece_bytes;
  options.scaler = scaler;
  options.max_norm = max_norm;
  options.norm = norm;
  options.host_threads = host_threads;
  options.release = release;
  return options;
}

// What OffloadedAdam and OffloadedLamb share: buckets, the step, the host
// state and its file.
template <class Optimizer>
void bind_offloaded_common(nb::class_<Owned<Offloaded<Optimizer>>>& c) {
  using PyOffloaded = Owned<Offloaded<Optimizer>>;
  c.def_prop_ro("num_buckets", [](const PyOffloaded& o) { return o.object->num_buckets(); })
      .def_prop_ro("bucket_of_tensor",
                   [](const PyOffloaded& o) {
                     const auto b = o.object->bucket_of_tensor();
                     return std::vector<int32_t>(b.begin(), b.end());
                   })
      .def(
          "bucket_tensors",
          [](const PyOffloaded& o, int bucket) {
            const auto t = o.object->bucket_tensors(bucket);
            return std::vector<size_t>(t.begin(), t.end());
          },
          nb::arg("bucket"))
      .def(
          "bucket_ready",
          [](PyOffloaded& o, int bucket, uintptr_t stream, std::optional<Arrays> grads, bool complete) {
            if (!grads) return o.object->bucket_ready(bucket, to_stream(stream), {}, complete);
            // Views only for the call: the copies are enqueued before it returns. The
            // framework keeps the gradients until the step's end (finish orders it), or
            // with release frees them once copy_stream's copies are done.
            const ViewList v = to_views(*grads, "grads");
            o.object->bucket_ready(bucket, to_stream(stream), v.views, complete);
          },
          nb::arg("bucket"), nb::arg("stream") = 0, nb::arg("grads") = nb::none(), nb::arg("complete") = true,
          "Bucket `bucket`'s gradients are ready in stream order on `stream`; `grads`: the bucket's "
          "gradients now, in bucket_tensors(bucket) order; `complete`: no more of this step's gradient comes "
          "for it. A second hand adds (with release) or replaces (without; only with a check).")
      .def_prop_ro("copy_stream", [](const PyOffloaded& o) { return reinterpret_cast<uintptr_t>(o.object->copy_stream().handle); },
                   "The CUDA stream (a handle) that copies handed gradients to the host.")
      .def_prop_ro("releases_gradients", [](const PyOffloaded& o) { return o.object->releases_gradients(); })
      .def(
          "finish",
          [](PyOffloaded& o, uintptr_t stream) {
            nb::gil_scoped_release released;  // waits for the host worker's CPU steps
            o.object->finish(to_stream(stream));
          },
          nb::arg("stream") = 0, "Hands the buckets not handed; `stream` waits for every copy-back.")
      .def("synchronize",
           [](PyOffloaded& o) {
             nb::gil_scoped_release released;
             o.object->synchronize();
           })
      .def_prop_rw("step_count", [](PyOffloaded& o) { return o.object->step_count(); },
                   [](PyOffloaded& o, int64_t steps) { o.object->set_step_count(steps); })
      .def_prop_ro("last_step_skipped", [](PyOffloaded& o) { return o.object->last_step_skipped(); })
      .def_prop_ro("last_grad_norm", [](PyOffloaded& o) { return o.object->last_grad_norm(); })
      .def_prop_ro(
          "last_step_times",
          [](PyOffloaded& o) {
            const OffloadStepTimes t = o.object->last_step_times();
            nb::dict out;
            out["span_ms"] = t.span_ms;
            out["copy_wait_ms"] = t.copy_wait_ms;
            out["update_ms"] = t.update_ms;
            return out;
          },
          "Where the host worker's time went in the last step (ms): span (first bucket handed to last "
          "copy-back queued), copy_wait (waiting for gradients to arrive), update (the CPU steps).")
      .def_prop_ro("checks_gradients", [](const PyOffloaded& o) { return o.object->checks_gradients(); })
      .def_prop_ro("loss_scale_device",
                   [](nb::handle self) -> nb::object {
                     Offloaded<Optimizer>& o = *nb::cast<PyOffloaded&>(self).object;
                     if (o.scaler() == nullptr) return nb::none();
                     return to_array(TensorView{const_cast<float*>(o.loss_scale_device()), 1, DType::f32,
                                                o.scaler()->device()},
                                     self);
                   },
                   "The loss scale S as a one-element float32 array on the device (None without a scaler).")
      .def("scaler_state",
           [](PyOffloaded& o) -> nb::object {
             if (o.object->scaler() == nullptr) return nb::none();
             const LossScalerState st = o.object->scaler()->state();
             return nb::make_tuple(st.scale, st.growth_tracker, st.hysteresis_left);
           })
      .def(
          "set_scaler_state",
          [](PyOffloaded& o, float scale, int32_t growth_tracker, int32_t hysteresis_left) {
            if (o.object->scaler() == nullptr) {
              throw_argument_error(ErrorCode::invalid_argument, "set_scaler_state", "scaler", "is none");
            }
            o.object->synchronize();
            o.object->scaler()->set_state({scale, growth_tracker, hysteresis_left});
          },
          nb::arg("scale"), nb::arg("growth_tracker"), nb::arg("hysteresis_left"))
      .def_prop_ro("masters",
                   [](nb::handle self) { return to_arrays(nb::cast<PyOffloaded&>(self).object->masters(), self); })
      .def_prop_ro("exp_avg",
                   [](nb::handle self) {
                     return to_arrays(nb::cast<PyOffloaded&>(self).object->host_optimizer().exp_avg(), self);
                   })
      .def_prop_ro("exp_avg_sq",
                   [](nb::handle self) {
                     return to_arrays(nb::cast<PyOffloaded&>(self).object->host_optimizer().exp_avg_sq(), self);
                   })
      .def_prop_ro("exp_avg_absmax",
                   [](nb::handle self) {
                     return to_arrays(nb::cast<PyOffloaded&>(self).object->host_optimizer().exp_avg_absmax(), self);
                   },
                   "With 8-bit (4-bit) moments, each tensor's absmax per 256-element (128-element) block (else "
                   "empty).")
      .def_prop_ro("exp_avg_sq_absmax",
                   [](nb::handle self) {
                     return to_arrays(nb::cast<PyOffloaded&>(self).object->host_optimizer().exp_avg_sq_absmax(), self);
                   })
      .def_prop_ro("host_bytes", [](const PyOffloaded& o) { return o.object->host_bytes(); })
      .def_prop_ro("device_bytes", [](const PyOffloaded& o) { return o.object->device_bytes(); },
                   "GPU bytes held: the check's scalars and scratch only (no optimizer state).")
      .def("refresh_masters", [](PyOffloaded& o) { o.object->refresh_masters(); },
           "Takes the masters from the model's weights (after they were changed outside the optimizer).")
      .def("save", [](PyOffloaded& o, const std::string& path) { o.object->save(path); }, nb::arg("path"))
      .def("load", [](PyOffloaded& o, const std::string& path) { o.object->load(path); }, nb::arg("path"));
}

}  // namespace

void bind_offload(nb::module_& m) {
  using PyAdam = Owned<OffloadedAdam>;
  nb::class_<PyAdam> adam(
      m, "OffloadedAdam",
      "Adam/AdamW with f32 masters and moments in host memory and the update on the CPU; the model's weights "
      "and gradients stay on one CUDA device. groups: as Adam's (the params are the model's weights). "
      "docs/offload.md says what overlaps with what.");
  adam.def(
      "__init__",
      [](PyAdam* self, const nb::list& groups, DType moment_dtype, std::optional<std::vector<int32_t>> buckets,
         size_t bucket_bytes, size_t piece_bytes, const std::optional<LossScalerOptions>& scaler, float max_norm,
         NormType norm, int host_threads, bool release, int32_t moment_bits) {
        new (self) PyAdam();
        auto g = to_groups<AdamGroup, AdamHyperparameters>(groups, self->keep);
        // The gradients given here are only looked at for their shapes
        // when bucket_ready() is always given the bucket's gradients.
        OffloadedOptions options = offload_options(moment_dtype, std::move(buckets), bucket_bytes, piece_bytes, scaler,
                                                   max_norm, norm, host_threads, release, moment_bits);
        self->object = std::make_unique<OffloadedAdam>(std::move(g), std::move(options));
      },
      nb::arg("groups"), nb::arg("moment_dtype") = DType::f32, nb::arg("buckets") = nb::none(),
      nb::arg("bucket_bytes") = OffloadedOptions{}.bucket_bytes, nb::arg("piece_bytes") = OffloadedOptions{}.piece_bytes,
      nb::arg("scaler") = nb::none(), nb::arg("max_norm") = 0.0f, nb::arg("norm") = NormType::l2,
      nb::arg("host_threads") = 0, nb::arg("release") = false, nb::arg("moment_bits") = 8);
  bind_offloaded_common(adam);
  adam.def("lr", [](PyAdam& o, int group) { return o.object->lr(group); }, nb::arg("group"))
      .def("set_lr", [](PyAdam& o, int group, float lr) { o.object->set_lr(group, lr); }, nb::arg("group"),
           nb::arg("lr"))
      .def_prop_ro("max_exp_avg_sq",
                   [](nb::handle self) {
                     return to_arrays(nb::cast<PyAdam&>(self).object->host_optimizer().max_exp_avg_sq(), self);
                   });

  using PyLamb = Owned<OffloadedLamb>;
  nb::class_<PyLamb> lamb(
      m, "OffloadedLamb",
      "LAMB with f32 masters and moments in host memory and the update on the CPU; the model's weights and "
      "gradients stay on one CUDA device. groups: as Lamb's (the params are the model's weights); max_norm: "
      "the global clipping, as MixedPrecisionLamb's. docs/offload.md says what overlaps with what.");
  lamb.def(
      "__init__",
      [](PyLamb* self, const nb::list& groups, float eta, DType moment_dtype, std::optional<std::vector<int32_t>> buckets,
         size_t bucket_bytes, size_t piece_bytes, const std::optional<LossScalerOptions>& scaler, float max_norm,
         NormType norm, int host_threads, bool release, int32_t moment_bits) {
        new (self) PyLamb();
        auto g = to_groups<LambGroup, LambHyperparameters>(groups, self->keep);
        OffloadedOptions options = offload_options(moment_dtype, std::move(buckets), bucket_bytes, piece_bytes, scaler,
                                                   max_norm, norm, host_threads, release, moment_bits);
        options.lamb.eta = eta;
        self->object = std::make_unique<OffloadedLamb>(std::move(g), std::move(options));
      },
      nb::arg("groups"), nb::arg("eta") = 1e-3f, nb::arg("moment_dtype") = DType::f32, nb::arg("buckets") = nb::none(),
      nb::arg("bucket_bytes") = OffloadedOptions{}.bucket_bytes, nb::arg("piece_bytes") = OffloadedOptions{}.piece_bytes,
      nb::arg("scaler") = nb::none(), nb::arg("max_norm") = 0.0f, nb::arg("norm") = NormType::l2,
      nb::arg("host_threads") = 0, nb::arg("release") = false, nb::arg("moment_bits") = 8);
  bind_offloaded_common(lamb);
  lamb.def_prop_rw("eta", [](PyLamb& o) { return o.object->eta(); }, [](PyLamb& o, float eta) { o.object->set_eta(eta); });
}

}  // namespace gradkit::python
