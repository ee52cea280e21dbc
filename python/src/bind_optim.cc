// The owning optimizers (moments, counters and learning rates on the
// device), the loss scaler, the mixed-precision wrapper and the sharded
// optimizers over a Communicator.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <vector>

#include "bindings.h"
#include "groups.h"
#include "gradkit/core/error.h"
#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/loss_scaler.h"
#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/sharded.h"
#include "tensors.h"

namespace gradkit::python {
namespace {

struct ScalerState {
  float scale;
  int32_t growth_tracker;
  int32_t hysteresis_left;
};

void bind_loss_scaler(nb::module_& m) {
  nb::enum_<LossScaling>(m, "LossScaling")
      .value("dynamic", LossScaling::dynamic)
      .value("fixed", LossScaling::fixed)
      .value("none", LossScaling::none);

  nb::class_<LossScalerOptions>(m, "LossScalerOptions", "PyTorch GradScaler's defaults; hysteresis 1 makes its decisions.")
      .def(
          "__init__",
          [](LossScalerOptions* o, LossScaling mode, float initial_scale, float growth_factor, float backoff_factor,
             int32_t growth_interval, int32_t hysteresis, float min_scale, float max_scale) {
            new (o) LossScalerOptions{mode, initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                                      min_scale, max_scale};
          },
          nb::arg("mode") = LossScaling::dynamic, nb::arg("initial_scale") = 65536.0f,
          nb::arg("growth_factor") = 2.0f, nb::arg("backoff_factor") = 0.5f, nb::arg("growth_interval") = 2000,
          nb::arg("hysteresis") = 1, nb::arg("min_scale") = 0.0f,
          nb::arg("max_scale") = std::numeric_limits<float>::infinity())
      .def_rw("mode", &LossScalerOptions::mode)
      .def_rw("initial_scale", &LossScalerOptions::initial_scale)
      .def_rw("growth_factor", &LossScalerOptions::growth_factor)
      .def_rw("backoff_factor", &LossScalerOptions::backoff_factor)
      .def_rw("growth_interval", &LossScalerOptions::growth_interval)
      .def_rw("hysteresis", &LossScalerOptions::hysteresis)
      .def_rw("min_scale", &LossScalerOptions::min_scale)
      .def_rw("max_scale", &LossScalerOptions::max_scale);

  using PyLossScaler = Shared<LossScaler>;  // the scale array keeps the memory, not the object
  nb::class_<PyLossScaler>(m, "LossScaler", "The loss scale, kept and updated on the device.")
      .def(
          "__init__",
          [](PyLossScaler* s, const std::string& device, const LossScalerOptions& options) {
            new (s) PyLossScaler{std::make_shared<LossScaler>(parse_device(device), options)};
          },
          nb::arg("device"), nb::arg("options") = LossScalerOptions{})
      .def_prop_ro(
          "scale_device",
          [](const PyLossScaler& s) {
            const LossScaler& scaler = *s.object;
            return to_array(TensorView{const_cast<float*>(scaler.scale_device()), 1, DType::f32, scaler.device()},
                            s.memory_owner());
          },
          "The current scale S as a one-element float32 array on the device (multiply the loss by it).")
      .def(
          "update",
          [](PyLossScaler& s, nb::handle found_inf, uintptr_t stream) {
            s.object->update(flag_pointer(found_inf, "found_inf"), to_stream(stream));
          },
          nb::arg("found_inf"), nb::arg("stream") = 0, "The decision after a step, from a bool on the device.")
      .def("state",
           [](const PyLossScaler& s) {
             const LossScalerState st = s.object->state();
             return nb::make_tuple(st.scale, st.growth_tracker, st.hysteresis_left);
           },
           "(scale, growth_tracker, hysteresis_left), read synchronously.")
      .def(
          "set_state",
          [](PyLossScaler& s, float scale, int32_t growth_tracker, std::optional<int32_t> hysteresis_left) {
            s.object->set_state({scale, growth_tracker, hysteresis_left.value_or(s.object->options().hysteresis)});
          },
          nb::arg("scale"), nb::arg("growth_tracker"), nb::arg("hysteresis_left") = nb::none(),
          "Synchronous write, validated.")
      .def_prop_ro("options", [](const PyLossScaler& s) { return s.object->options(); });
}

template <class Optimizer>
void bind_state_io(nb::class_<Owned<Optimizer>>& c) {
  c.def("save", [](const Owned<Optimizer>& o, const std::string& path) { o.object->save(path); }, nb::arg("path"))
      .def("load", [](Owned<Optimizer>& o, const std::string& path) { o.object->load(path); }, nb::arg("path"));
}

void bind_adam(nb::module_& m) {
  nb::class_<AdamOptions>(m, "AdamOptions")
      .def(nb::init<>())
      .def_rw("moment_dtype", &AdamOptions::moment_dtype);
  using PyAdam = Owned<Adam>;
  nb::class_<PyAdam> c(m, "Adam",
                       "Owning Adam/AdamW: moments, step counter and per-group learning rates on the device. "
                       "groups: a list of {'params', 'grads', 'model_copy' (optional), 'hyperparameters'}.");
  c.def(
       "__init__",
       [](PyAdam* self, const nb::list& groups, DType moment_dtype) {
         new (self) PyAdam();
         auto g = to_groups<AdamGroup, AdamHyperparameters>(groups, self->keep);
         self->object = std::make_unique<Adam>(std::move(g), AdamOptions{moment_dtype});
       },
       nb::arg("groups"), nb::arg("moment_dtype") = DType::f32)
      .def(
          "step",
          [](PyAdam& a, uintptr_t stream, nb::handle found_inf,
             nb::handle grad_scale_device, float grad_scale) {
            a.object->step(to_stream(stream), flag_pointer(found_inf, "found_inf"),
                           scalar_pointer<float>(grad_scale_device, "grad_scale_device", "float32"), grad_scale);
          },
          nb::arg("stream") = 0, nb::arg("found_inf") = nb::none(), nb::arg("grad_scale_device") = nb::none(),
          nb::arg("grad_scale") = 1.0f)
      .def_prop_ro("step_count", [](const PyAdam& a) { return a.object->step_count(); })
      .def("lr", [](const PyAdam& a, int group) { return a.object->lr(group); }, nb::arg("group"))
      .def("set_lr", [](PyAdam& a, int group, float lr) { a.object->set_lr(group, lr); }, nb::arg("group"),
           nb::arg("lr"))
      .def_prop_ro("exp_avg", [](nb::handle self) { return to_arrays(nb::cast<PyAdam&>(self).object->exp_avg(), self); })
      .def_prop_ro("exp_avg_sq",
                   [](nb::handle self) { return to_arrays(nb::cast<PyAdam&>(self).object->exp_avg_sq(), self); });
  bind_state_io(c);
}

void bind_lamb(nb::module_& m) {
  using PyLamb = Owned<Lamb>;
  nb::class_<PyLamb> c(m, "Lamb", "Owning LAMB: moments, step counter and eta on the device.");
  c.def(
       "__init__",
       [](PyLamb* self, const nb::list& groups, float eta, DType moment_dtype, int32_t moment_bits) {
         new (self) PyLamb();
         auto g = to_groups<LambGroup, LambHyperparameters>(groups, self->keep);
         self->object = std::make_unique<Lamb>(std::move(g), LambOptions{eta, moment_dtype, moment_bits});
       },
       nb::arg("groups"), nb::arg("eta") = 1e-3f, nb::arg("moment_dtype") = DType::f32, nb::arg("moment_bits") = 8)
      .def(
          "step",
          [](PyLamb& l, uintptr_t stream, float loss_scale, float gradient_norm, nb::handle found_inf) {
            LambStep in;
            in.loss_scale = loss_scale;
            in.gradient_norm = gradient_norm;
            in.found_inf = flag_pointer(found_inf, "found_inf");
            l.object->step(to_stream(stream), in);
          },
          nb::arg("stream") = 0, nb::arg("loss_scale") = 1.0f, nb::arg("gradient_norm") = -1.0f,
          nb::arg("found_inf") = nb::none())
      .def_prop_ro("step_count", [](const PyLamb& l) { return l.object->step_count(); })
      .def_prop_rw("eta", [](const PyLamb& l) { return l.object->eta(); },
                   [](PyLamb& l, float eta) { l.object->set_eta(eta); })
      .def_prop_ro("exp_avg", [](nb::handle self) { return to_arrays(nb::cast<PyLamb&>(self).object->exp_avg(), self); })
      .def_prop_ro("exp_avg_sq",
                   [](nb::handle self) { return to_arrays(nb::cast<PyLamb&>(self).object->exp_avg_sq(), self); });
  bind_state_io(c);
}

template <class Optimizer, class Hyperparameters>
void bind_mixed_precision(nb::module_& m, const char* name) {
  using Mp = MixedPrecision<Optimizer>;
  using PyMp = Owned<Mp>;
  nb::class_<PyMp> c(m, name,
                     "ONNX Runtime's FP16_Optimizer: f32 masters of the model's f16/bf16 weights, the check, the "
                     "update (which writes the model's weights) and the loss scaler, all on the device.");
  c.def(
       "__init__",
       [](PyMp* self, const nb::list& groups, const LossScalerOptions& scaler, float max_norm, NormType norm,
          MasterStorage master) {
         new (self) PyMp();
         auto g = to_groups<typename Optimizer::Group, Hyperparameters>(groups, self->keep);
         self->object = std::make_unique<Mp>(std::move(g), MixedPrecisionOptions{scaler, max_norm, norm, master});
       },
       nb::arg("groups"), nb::arg("scaler") = LossScalerOptions{}, nb::arg("max_norm") = 0.0f,
       nb::arg("norm") = NormType::l2, nb::arg("master") = MasterStorage::f32)
      .def("step", [](PyMp& p, uintptr_t stream) { p.object->step(to_stream(stream)); }, nb::arg("stream") = 0)
      .def_prop_ro("loss_scale", [](const PyMp& p) { return p.object->loss_scale(); })
      .def_prop_ro("loss_scale_device",
                   [](nb::handle self) {
                     Mp& mp = *nb::cast<PyMp&>(self).object;
                     return to_array(
                         TensorView{const_cast<float*>(mp.loss_scale_device()), 1, DType::f32, mp.scaler().device()},
                         self);
                   })
      .def_prop_ro("last_step_skipped", [](const PyMp& p) { return p.object->last_step_skipped(); })
      .def_prop_ro("last_grad_norm", [](const PyMp& p) { return p.object->last_grad_norm(); })
      .def_prop_ro("masters", [](nb::handle self) { return to_arrays(nb::cast<PyMp&>(self).object->masters(), self); })
      .def_prop_ro("weight_remainders",
                   [](nb::handle self) { return to_arrays(nb::cast<PyMp&>(self).object->weight_remainders(), self); });
  bind_state_io(c);
}

template <class Optimizer, class Hyperparameters>
void bind_sharded(nb::module_& m, const char* name) {
  using S = Sharded<Optimizer>;
  using PySharded = Owned<S>;
  nb::class_<PySharded> c(m, name,
                          "The optimizer with its state split across the ranks of `comm` (ZeRO stages 1 and 2). "
                          "groups: as the optimizer's, the whole model in the layout's order, params and grads "
                          "views of two GradientArenas made from `layout`.");
  c.def(
       "__init__",
       [](PySharded* self, Communicator& comm, const ShardedLayout& layout, const nb::list& groups,
          const std::optional<LossScalerOptions>& scaler, float max_norm, NormType norm, DType moment_dtype,
          uintptr_t communication_stream, float eta, int update_parts, MasterStorage master, int32_t moment_bits) {
         new (self) PySharded();
         auto g = to_groups<typename Optimizer::Group, Hyperparameters>(groups, self->keep);
         ShardedOptions options;
         if (scaler) options.scaler = *scaler;
         options.max_norm = max_norm;
         options.norm = norm;
         options.adam.moment_dtype = moment_dtype;
         options.adam.moment_bits = moment_bits;
         options.lamb.moment_dtype = moment_dtype;
         options.lamb.moment_bits = moment_bits;
         options.lamb.eta = eta;
         options.communication_stream = to_stream(communication_stream);
         options.update_parts = update_parts;
         options.master = master;
         self->object = std::make_unique<S>(comm, layout, std::move(g), options);
       },
       nb::arg("comm"), nb::arg("layout"), nb::arg("groups"), nb::arg("scaler") = nb::none(),
       nb::arg("max_norm") = 0.0f, nb::arg("norm") = NormType::l2, nb::arg("moment_dtype") = DType::f32,
       nb::arg("communication_stream") = 0, nb::arg("eta") = 1e-3f,
       nb::arg("update_parts") = ShardedOptions{}.update_parts, nb::arg("master") = MasterStorage::f32,
       nb::arg("moment_bits") = 8, nb::keep_alive<1, 2>())
      .def("step", [](PySharded& s, uintptr_t stream) { s.object->step(to_stream(stream)); }, nb::arg("stream") = 0,
           "Reduce-scatter, check, the update of the shard, scaler, all-gather; enqueued on `stream` (NCCL).")
      .def(
          "mark_ready",
          [](PySharded& s, size_t tensor, uintptr_t stream) { s.object->mark_ready(tensor, to_stream(stream)); },
          nb::arg("tensor"), nb::arg("stream") = 0,
          "Stage 2: tensor's gradient is final once `stream`'s work so far has run.")
      .def_prop_ro("loss_scale", [](const PySharded& s) { return s.object->loss_scale(); })
      .def_prop_ro("loss_scale_device",
                   [](nb::handle self) {
                     S& s = *nb::cast<PySharded&>(self).object;
                     return to_array(TensorView{const_cast<float*>(s.loss_scale_device()), 1, DType::f32, s.device()},
                                     self);
                   })
      .def_prop_ro("last_step_skipped", [](const PySharded& s) { return s.object->last_step_skipped(); })
      .def_prop_ro("last_grad_norm", [](const PySharded& s) { return s.object->last_grad_norm(); })
      .def_prop_ro("step_count", [](const PySharded& s) { return s.object->step_count(); })
      .def_prop_ro("state_bytes", [](const PySharded& s) { return s.object->state_bytes(); },
                   "Bytes of masters and moments this rank holds.");
  if constexpr (std::is_same_v<Optimizer, Adam>) {
    c.def("lr", [](const PySharded& s, int group) { return s.object->lr(group); }, nb::arg("group"))
        .def("set_lr", [](PySharded& s, int group, float lr) { s.object->set_lr(group, lr); }, nb::arg("group"),
             nb::arg("lr"));
  } else {
    c.def_prop_rw("eta", [](const PySharded& s) { return s.object->eta(); },
                  [](PySharded& s, float eta) { s.object->set_eta(eta); });
  }
  bind_state_io(c);
}

void bind_sharded_layout_and_optimizers(nb::module_& m) {
  nb::class_<ShardedLayout>(m, "ShardedLayout",
                            "Where a sharded model's tensors lie in its flat buffers and which slice of every bucket "
                            "each rank owns (docs/ops.md, ShardedLayout).")
      .def(
          "__init__",
          [](ShardedLayout* l, const std::vector<int64_t>& numels, int world_size, int64_t bucket_elements,
             int64_t alignment) { new (l) ShardedLayout(ShardedLayout::make(numels, world_size, bucket_elements, alignment)); },
          nb::arg("numels"), nb::arg("world_size"), nb::arg("bucket_elements") = 0, nb::arg("alignment") = 64)
      .def_ro("world_size", &ShardedLayout::world_size)
      .def_ro("alignment", &ShardedLayout::alignment)
      .def_ro("numels", &ShardedLayout::numels)
      .def_ro("offsets", &ShardedLayout::offsets)
      .def_ro("total", &ShardedLayout::total)
      .def_prop_ro("num_buckets", [](const ShardedLayout& l) { return l.buckets.size(); })
      .def("shard_elements", &ShardedLayout::shard_elements)
      .def(
          "pieces",
          [](const ShardedLayout& l, int rank) {
            nb::list out;
            for (const ShardedLayout::Piece& p : l.pieces(rank)) {
              out.append(nb::make_tuple(p.tensor, p.bucket, p.offset, p.count, p.in_slice));
            }
            return out;
          },
          nb::arg("rank"), "(tensor, bucket, offset in tensor, count, offset in slice) of each piece rank owns.");

  bind_sharded<Adam, AdamHyperparameters>(m, "ShardedAdam");
  bind_sharded<Lamb, LambHyperparameters>(m, "ShardedLamb");
}

}  // namespace

void bind_optim(nb::module_& m) {
  bind_loss_scaler(m);
  bind_adam(m);
  bind_lamb(m);
  nb::enum_<MasterStorage>(m, "MasterStorage",
                           "Where an f16/bf16 model's f32 masters live: f32 tensors, or i16 remainders completing "
                           "bf16 weights (docs/ops.md, the remainder master).")
      .value("f32", MasterStorage::f32)
      .value("remainder", MasterStorage::remainder);
  bind_mixed_precision<Adam, AdamHyperparameters>(m, "MixedPrecisionAdam");
  bind_mixed_precision<Lamb, LambHyperparameters>(m, "MixedPrecisionLamb");
  bind_sharded_layout_and_optimizers(m);
}

}  // namespace gradkit::python
