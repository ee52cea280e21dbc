// The public kernels over tensor lists: gradient control, the Adam and LAMB
// updates, and the gradient check. Each plan object keeps the arrays it was
// made from alive, since the plan holds their raw pointers.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <vector>

#include "bindings.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/ops/adam.h"
#include "gradkit/ops/grad_check.h"
#include "gradkit/ops/gradient.h"
#include "gradkit/ops/lamb.h"
#include "gradkit/ops/step_counter.h"
#include "tensors.h"

namespace gradkit::python {
namespace {

using Arrays = std::vector<Array>;

struct PyZeroPlan {
  ViewList buffers;
  ZeroPlan plan;
  explicit PyZeroPlan(const Arrays& b) : buffers(to_views(b, "buffers")), plan(buffers.views) {}
};

struct PyAccumulatePlan {
  ViewList buffers, values;
  AccumulatePlan plan;
  PyAccumulatePlan(const Arrays& b, const Arrays& v)
      : buffers(to_views(b, "buffers")), values(to_views(v, "values")), plan(buffers.views, values.views) {}
};

Flag input_flag(const std::optional<bool>& host, nb::handle device, const char* arg) {
  if (!device.is_none()) return Flag::device(flag_pointer(device, arg));
  if (host) return Flag::host(*host);
  return Flag::none();
}

struct PyAdamPlan {
  ViewList weights, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, model_copy, exp_avg_absmax, exp_avg_sq_absmax,
      weight_remainder;
  AdamPlan plan;
  PyAdamPlan(const Arrays& w, const Arrays& g, const Arrays& m, const Arrays& v,
             const std::vector<AdamHyperparameters>& hyper, const std::vector<int32_t>& groups, const Arrays& vmax,
             const Arrays& copy, const Arrays& m_absmax, const Arrays& v_absmax, const Arrays& remainder,
             bool hold_grads, int32_t moment_bits)
      : weights(to_views(w, "weights")),
        grads(to_views(g, "grads")),
        exp_avg(to_views(m, "exp_avg")),
        exp_avg_sq(to_views(v, "exp_avg_sq")),
        max_exp_avg_sq(to_views(vmax, "max_exp_avg_sq")),
        model_copy(to_views(copy, "model_copy")),
        exp_avg_absmax(to_views(m_absmax, "exp_avg_absmax")),
        exp_avg_sq_absmax(to_views(v_absmax, "exp_avg_sq_absmax")),
        weight_remainder(to_views(remainder, "weight_remainder")),
        plan({weights.views, grads.views, exp_avg.views, exp_avg_sq.views, max_exp_avg_sq.views, model_copy.views,
              exp_avg_absmax.views, exp_avg_sq_absmax.views, weight_remainder.views, moment_bits},
             hyper, groups) {
    if (!hold_grads) grads.arrays.clear();
  }
};

struct PyLambPlan {
  ViewList weights, grads, exp_avg, exp_avg_sq, model_copy, update, exp_avg_absmax, exp_avg_sq_absmax,
      weight_remainder;
  LambPlan plan;
  Buffer tensor_index;  // 0 .. n-1 on the plan's device, for a step in two passes (made at the first)
  PyLambPlan(const Arrays& w, const Arrays& g, const Arrays& m, const Arrays& v,
             const std::vector<LambHyperparameters>& hyper, const std::vector<int32_t>& groups, const Arrays& copy,
             const Arrays& upd, const Arrays& m_absmax, const Arrays& v_absmax, const Arrays& remainder,
             bool hold_grads, int32_t moment_bits)
      : weights(to_views(w, "weights")),
        grads(to_views(g, "grads")),
        exp_avg(to_views(m, "exp_avg")),
        exp_avg_sq(to_views(v, "exp_avg_sq")),
        model_copy(to_views(copy, "model_copy")),
        update(to_views(upd, "update")),
        exp_avg_absmax(to_views(m_absmax, "exp_avg_absmax")),
        exp_avg_sq_absmax(to_views(v_absmax, "exp_avg_sq_absmax")),
        weight_remainder(to_views(remainder, "weight_remainder")),
        plan({weights.views, grads.views, exp_avg.views, exp_avg_sq.views, model_copy.views, update.views,
              exp_avg_absmax.views, exp_avg_sq_absmax.views, weight_remainder.views, moment_bits},
             hyper, groups) {
    if (!hold_grads) grads.arrays.clear();
  }
};

constexpr std::string_view kLambStep = "LambPlan.step";

// A LAMB step in two passes (LambSplit) as Python asks for it: tensor i's
// sums at sums[2i], [2i + 1] of a row of 2n doubles; the second pass reads
// `rows` such rows, one after another. Validated here: the plan reads the
// sums through raw device pointers.
LambSplit lamb_split(PyLambPlan& p, const std::string& pass, nb::handle sums, int rows) {
  if (pass == "both") {
    if (!sums.is_none()) throw_argument_error(ErrorCode::invalid_argument, kLambStep, "sums", "is given, expected None "
                                              "with split='both' (sums are for a step in two passes)");
    return {};
  }
  if (pass != "first" && pass != "second") {
    throw_argument_error(ErrorCode::invalid_argument, kLambStep, "split",
                         "is '" + pass + "', expected 'both', 'first' or 'second'");
  }
  if (rows < 1) throw_argument_error(ErrorCode::invalid_argument, kLambStep, "rows", "is " + std::to_string(rows) +
                                     ", expected at least 1");
  const int64_t n = static_cast<int64_t>(p.plan.plan().num_tensors());
  const int used_rows = pass == "first" ? 1 : rows;
  auto* data = scalar_pointer<double>(sums, "sums", "float64", 2 * n * used_rows);
  if (data == nullptr) throw_argument_error(ErrorCode::invalid_argument, kLambStep, "sums", "is None, expected "
                                            "float64 memory for the two-pass step's sums");
  if (scalar_device(sums, "sums") != p.plan.plan().device()) {
    throw_argument_error(ErrorCode::invalid_argument, kLambStep, "sums", "is on another device than the plan's tensors");
  }
  if (p.tensor_index.bytes() == 0) {
    std::vector<int32_t> index(static_cast<size_t>(n));
    for (int32_t i = 0; i < static_cast<int32_t>(n); ++i) index[static_cast<size_t>(i)] = i;
    Buffer buffer(p.plan.plan().device(), index.size() * sizeof(int32_t));
    copy_from_host(buffer.data(), buffer.device(), index.data(), index.size() * sizeof(int32_t));
    p.tensor_index = std::move(buffer);
  }
  const auto* index = static_cast<const int32_t*>(p.tensor_index.data());
  if (pass == "first") return {LambPass::first, data, index};
  return {LambPass::second, data, index, rows, 2 * n};
}

struct PyGradientCheckPlan {
  ViewList grads;
  GradientCheckPlan plan;
  PyGradientCheckPlan(const Arrays& g, GradientCheckOptions options, bool hold_grads)
      : grads(to_views(g, "grads")), plan(grads.views, options) {
    if (!hold_grads) grads.arrays.clear();
  }
};

// Re-points a plan's gradients; the new arrays replace the kept ones only
// once the plan has taken them.
// With `hold` false the plan does not keep the gradient arrays alive: a
// framework whose gradients are freed and made anew each step (PyTorch's
// zero_grad(set_to_none=True)) then gets the same memory back, and re-points
// the plan (set_grads) before any step after the old arrays may have gone.
template <class Plan>
void set_grads(ViewList& kept, Plan& plan, const Arrays& grads, bool hold, uintptr_t stream) {
  ViewList next = to_views(grads, "grads");
  plan.set_grads(next.views, to_stream(stream));
  kept = std::move(next);
  if (!hold) kept.arrays.clear();
}

}  // namespace

void bind_ops(nb::module_& m) {
  m.def(
      "zero", [](const Arrays& buffers, uintptr_t stream) { zero(to_views(buffers, "buffers").views, to_stream(stream)); },
      nb::arg("buffers"), nb::arg("stream") = 0, "buffer = +0 for every buffer (unplanned; see ZeroPlan).");

  nb::class_<PyZeroPlan>(m, "ZeroPlan", "Zeroes a list planned once: O(1) host work per run.")
      .def(nb::init<const Arrays&>(), nb::arg("buffers"))
      .def("run", [](const PyZeroPlan& p, uintptr_t stream) { p.plan.run(to_stream(stream)); }, nb::arg("stream") = 0);

  nb::class_<PyAccumulatePlan>(m, "AccumulatePlan", "buffer += value (or = value) over lists planned once.")
      .def(nb::init<const Arrays&, const Arrays&>(), nb::arg("buffers"), nb::arg("values"))
      .def(
          "accumulate",
          [](const PyAccumulatePlan& p, std::optional<bool> do_update, nb::handle do_update_device,
             uintptr_t stream) {
            p.plan.accumulate(input_flag(do_update, do_update_device, "do_update_device"), to_stream(stream));
          },
          nb::arg("do_update") = nb::none(), nb::arg("do_update_device") = nb::none(), nb::arg("stream") = 0)
      .def(
          "accumulate_v2",
          [](const PyAccumulatePlan& p, std::optional<bool> overwrite, nb::handle overwrite_device,
             nb::handle updated_device, uintptr_t stream) {
            const Flag updated = updated_device.is_none() ? Flag::none()
                                                          : Flag::device(flag_pointer(updated_device, "updated_device"));
            p.plan.accumulate_v2(input_flag(overwrite, overwrite_device, "overwrite_device"), updated,
                                 to_stream(stream));
          },
          nb::arg("overwrite") = nb::none(), nb::arg("overwrite_device") = nb::none(),
          nb::arg("updated_device") = nb::none(), nb::arg("stream") = 0);

  m.def(
      "advance_step",
      [](nb::handle counter, nb::handle skip, uintptr_t stream) {
        int64_t* c = scalar_pointer<int64_t>(counter, "counter", "int64");
        if (c == nullptr) throw_argument_error(ErrorCode::null_pointer, "advance_step", "counter", "is None");
        advance_step(c, scalar_device(counter, "counter"), flag_pointer(skip, "skip"), to_stream(stream));
      },
      nb::arg("counter"), nb::arg("skip") = nb::none(), nb::arg("stream") = 0,
      "counter (one int64 on its device) += 1 unless skip (a bool on the same device) is true.");

  nb::enum_<WeightDecay>(m, "WeightDecay")
      .value("l2", WeightDecay::l2)
      .value("decoupled", WeightDecay::decoupled)
      .value("hugging_face", WeightDecay::hugging_face);

  nb::class_<AdamHyperparameters>(m, "AdamHyperparameters")
      .def(
          "__init__",
          [](AdamHyperparameters* h, float lr, float beta1, float beta2, float eps, float weight_decay,
             WeightDecay decay, bool bias_correction, bool amsgrad, bool maximize) {
            new (h) AdamHyperparameters{lr, beta1, beta2, eps, weight_decay, decay, bias_correction, amsgrad, maximize};
          },
          nb::arg("lr") = 1e-3f, nb::arg("beta1") = 0.9f, nb::arg("beta2") = 0.999f, nb::arg("eps") = 1e-8f,
          nb::arg("weight_decay") = 0.0f, nb::arg("decay") = WeightDecay::decoupled,
          nb::arg("bias_correction") = true, nb::arg("amsgrad") = false, nb::arg("maximize") = false)
      .def_rw("lr", &AdamHyperparameters::lr)
      .def_rw("beta1", &AdamHyperparameters::beta1)
      .def_rw("beta2", &AdamHyperparameters::beta2)
      .def_rw("eps", &AdamHyperparameters::eps)
      .def_rw("weight_decay", &AdamHyperparameters::weight_decay)
      .def_rw("decay", &AdamHyperparameters::decay)
      .def_rw("bias_correction", &AdamHyperparameters::bias_correction)
      .def_rw("amsgrad", &AdamHyperparameters::amsgrad)
      .def_rw("maximize", &AdamHyperparameters::maximize);

  nb::class_<PyAdamPlan>(m, "AdamPlan",
                         "Adam/AdamW over tensor lists planned once (docs/ops.md, adam_step). Tensor i of each "
                         "list belongs to one parameter; groups[i] picks its hyperparameters.")
      .def(nb::init<const Arrays&, const Arrays&, const Arrays&, const Arrays&, const std::vector<AdamHyperparameters>&,
                    const std::vector<int32_t>&, const Arrays&, const Arrays&, const Arrays&, const Arrays&,
                    const Arrays&, bool, int32_t>(),
           nb::arg("weights"), nb::arg("grads"), nb::arg("exp_avg"), nb::arg("exp_avg_sq"),
           nb::arg("hyperparameters"), nb::arg("groups") = std::vector<int32_t>{},
           nb::arg("max_exp_avg_sq") = Arrays{}, nb::arg("model_copy") = Arrays{},
           nb::arg("exp_avg_absmax") = Arrays{}, nb::arg("exp_avg_sq_absmax") = Arrays{},
           nb::arg("weight_remainder") = Arrays{}, nb::arg("hold_grads") = true, nb::arg("moment_bits") = 8,
           "uint8 moments are 8-bit blockwise, each with its float32 absmax list (quant_blocks(numel) per "
           "tensor), or with moment_bits=4 4-bit blockwise (quant4_bytes(numel) bytes, quant4_blocks(numel) "
           "absmax); bfloat16 weights with weight_remainder (int16) hold their float32 master exactly.")
      .def(
          "step",
          [](const PyAdamPlan& p, int64_t step, nb::handle step_device, nb::handle lr_device,
             float grad_scale, nb::handle grad_scale_device, nb::handle found_inf, uintptr_t stream) {
            AdamStepInputs in;
            in.step = step;
            in.step_device = scalar_pointer<int64_t>(step_device, "step_device", "int64");
            in.lr_device = scalar_pointer<float>(lr_device, "lr_device", "float32",
                                                 static_cast<int64_t>(p.plan.hyperparameters().size()));
            in.grad_scale = grad_scale;
            in.grad_scale_device = scalar_pointer<float>(grad_scale_device, "grad_scale_device", "float32");
            in.found_inf = flag_pointer(found_inf, "found_inf");
            p.plan.step(in, to_stream(stream));
          },
          nb::arg("step") = 1, nb::arg("step_device") = nb::none(), nb::arg("lr_device") = nb::none(),
          nb::arg("grad_scale") = 1.0f, nb::arg("grad_scale_device") = nb::none(), nb::arg("found_inf") = nb::none(),
          nb::arg("stream") = 0,
          "One update. lr_device: one float32 per group on the plan's device, replacing the plan's lrs; "
          "found_inf: a bool on the device, true skips the whole step.")
      .def("set_grads",
           [](PyAdamPlan& p, const Arrays& g, bool hold, uintptr_t stream) { set_grads(p.grads, p.plan, g, hold, stream); },
           nb::arg("grads"), nb::arg("hold_grads") = true, nb::arg("stream") = 0,
           "Points the plan at new gradient arrays (same sizes and dtype): one small copy enqueued on `stream`, "
           "no new plan; re-point on the stream the plan launches on.")
      .def("set_hyperparameters",
           [](PyAdamPlan& p, const std::vector<AdamHyperparameters>& h) { p.plan.set_hyperparameters(h); },
           nb::arg("hyperparameters"))
      .def_prop_ro("hyperparameters", [](const PyAdamPlan& p) {
        return std::vector<AdamHyperparameters>(p.plan.hyperparameters().begin(), p.plan.hyperparameters().end());
      })
      .def_prop_ro("num_tensors", [](const PyAdamPlan& p) { return p.plan.plan().num_tensors(); })
      .def_prop_ro("quantized_moments", [](const PyAdamPlan& p) { return p.plan.quantized_moments(); })
      .def_prop_ro("has_weight_remainder", [](const PyAdamPlan& p) { return p.plan.has_weight_remainder(); });

  nb::class_<LambHyperparameters>(m, "LambHyperparameters")
      .def(
          "__init__",
          [](LambHyperparameters* h, float alpha, float beta, float lambda, float epsilon, float ratio_min,
             float ratio_max, float max_norm, bool bias_correction) {
            new (h) LambHyperparameters{alpha, beta, lambda, epsilon, ratio_min, ratio_max, max_norm, bias_correction};
          },
          nb::arg("alpha") = 0.9f, nb::arg("beta") = 0.999f, nb::arg("lambda_") = 0.0f, nb::arg("epsilon") = 1e-6f,
          nb::arg("ratio_min") = -std::numeric_limits<float>::infinity(),
          nb::arg("ratio_max") = std::numeric_limits<float>::infinity(), nb::arg("max_norm") = 1.0f,
          nb::arg("bias_correction") = true)
      .def_rw("alpha", &LambHyperparameters::alpha)
      .def_rw("beta", &LambHyperparameters::beta)
      .def_rw("lambda_", &LambHyperparameters::lambda)
      .def_rw("epsilon", &LambHyperparameters::epsilon)
      .def_rw("ratio_min", &LambHyperparameters::ratio_min)
      .def_rw("ratio_max", &LambHyperparameters::ratio_max)
      .def_rw("max_norm", &LambHyperparameters::max_norm)
      .def_rw("bias_correction", &LambHyperparameters::bias_correction);

  nb::class_<PyLambPlan>(m, "LambPlan", "LAMB (ONNX Runtime's semantics) over tensor lists planned once.")
      .def(nb::init<const Arrays&, const Arrays&, const Arrays&, const Arrays&, const std::vector<LambHyperparameters>&,
                    const std::vector<int32_t>&, const Arrays&, const Arrays&, const Arrays&, const Arrays&,
                    const Arrays&, bool, int32_t>(),
           nb::arg("weights"), nb::arg("grads"), nb::arg("exp_avg"), nb::arg("exp_avg_sq"),
           nb::arg("hyperparameters"), nb::arg("groups") = std::vector<int32_t>{}, nb::arg("model_copy") = Arrays{},
           nb::arg("update") = Arrays{}, nb::arg("exp_avg_absmax") = Arrays{}, nb::arg("exp_avg_sq_absmax") = Arrays{},
           nb::arg("weight_remainder") = Arrays{}, nb::arg("hold_grads") = true, nb::arg("moment_bits") = 8,
           "uint8 moments are 8-bit blockwise, each with its float32 absmax list (quant_blocks(numel) per tensor), "
           "or with moment_bits=4 4-bit blockwise (quant4_bytes(numel) bytes, quant4_blocks(numel) absmax); "
           "bfloat16 weights with weight_remainder (int16; float moments only) hold their float32 master exactly.")
      .def(
          "step",
          [](PyLambPlan& p, float eta, nb::handle eta_device, float loss_scale,
             nb::handle loss_scale_device, float gradient_norm, nb::handle gradient_norm_device,
             int64_t step, nb::handle step_device, nb::handle found_inf, const std::string& split,
             nb::handle sums, int rows, uintptr_t stream) {
            LambStepInputs in;
            in.split = lamb_split(p, split, sums, rows);
            in.eta = eta;
            in.eta_device = scalar_pointer<float>(eta_device, "eta_device", "float32");
            in.loss_scale = loss_scale;
            in.loss_scale_device = scalar_pointer<float>(loss_scale_device, "loss_scale_device", "float32");
            in.gradient_norm = gradient_norm;
            in.gradient_norm_device = scalar_pointer<float>(gradient_norm_device, "gradient_norm_device", "float32");
            in.step = step;
            in.step_device = scalar_pointer<int64_t>(step_device, "step_device", "int64");
            in.found_inf = flag_pointer(found_inf, "found_inf");
            p.plan.step(in, to_stream(stream));
          },
          nb::arg("eta") = 1e-3f, nb::arg("eta_device") = nb::none(), nb::arg("loss_scale") = 1.0f,
          nb::arg("loss_scale_device") = nb::none(), nb::arg("gradient_norm") = -1.0f,
          nb::arg("gradient_norm_device") = nb::none(), nb::arg("step") = 1, nb::arg("step_device") = nb::none(),
          nb::arg("found_inf") = nb::none(), nb::arg("split") = "both", nb::arg("sums") = nb::none(),
          nb::arg("rows") = 1, nb::arg("stream") = 0,
          "split='first' runs pass 1 and writes tensor i's sums of w^2 and d^2 to sums[2i], sums[2i+1] "
          "(float64, 2n); split='second' takes `rows` such rows (float64, rows * 2n; every row's sums "
          "added in row order: the ranks' shards of one model) and finishes the step. Default: the whole step.")
      .def("set_grads",
           [](PyLambPlan& p, const Arrays& g, bool hold, uintptr_t stream) { set_grads(p.grads, p.plan, g, hold, stream); },
           nb::arg("grads"), nb::arg("hold_grads") = true, nb::arg("stream") = 0)
      .def("set_hyperparameters",
           [](PyLambPlan& p, const std::vector<LambHyperparameters>& h) { p.plan.set_hyperparameters(h); },
           nb::arg("hyperparameters"))
      .def_prop_ro("num_tensors", [](const PyLambPlan& p) { return p.plan.plan().num_tensors(); })
      .def_prop_ro("has_weight_remainder", [](const PyLambPlan& p) { return p.plan.has_weight_remainder(); });

  nb::enum_<NormType>(m, "NormType").value("l2", NormType::l2).value("infinity", NormType::infinity);

  nb::class_<PyGradientCheckPlan>(m, "GradientCheckPlan",
                                  "One read pass over gradients: Inf/NaN, norms of the unscaled gradients, and the "
                                  "divisor (loss scale / clip coefficient) the optimizer applies.")
      .def(
          "__init__",
          [](PyGradientCheckPlan* p, const Arrays& grads, NormType norm, float max_norm, bool write_unscaled,
             bool hold_grads) {
            new (p) PyGradientCheckPlan(grads, GradientCheckOptions{norm, max_norm, write_unscaled}, hold_grads);
          },
          nb::arg("grads"), nb::arg("norm") = NormType::l2, nb::arg("max_norm") = 0.0f,
          nb::arg("write_unscaled") = false, nb::arg("hold_grads") = true)
      .def(
          "check",
          [](const PyGradientCheckPlan& p, nb::handle found_inf, nb::handle grad_divisor,
             nb::handle global_norm, nb::handle tensor_norms, nb::handle partial, float loss_scale,
             nb::handle loss_scale_device, uintptr_t stream) {
            GradientCheckOutputs out;
            out.partial = scalar_pointer<double>(partial, "partial", "float64", 2);
            out.found_inf = flag_pointer(found_inf, "found_inf");
            out.grad_divisor = scalar_pointer<float>(grad_divisor, "grad_divisor", "float32");
            out.global_norm = scalar_pointer<float>(global_norm, "global_norm", "float32");
            out.tensor_norms = scalar_pointer<float>(tensor_norms, "tensor_norms", "float32",
                                                     static_cast<int64_t>(p.plan.plan().num_tensors()));
            p.plan.check(out, loss_scale, scalar_pointer<float>(loss_scale_device, "loss_scale_device", "float32"),
                         to_stream(stream));
          },
          nb::arg("found_inf") = nb::none(), nb::arg("grad_divisor") = nb::none(), nb::arg("global_norm") = nb::none(),
          nb::arg("tensor_norms") = nb::none(), nb::arg("partial") = nb::none(), nb::arg("loss_scale") = 1.0f,
          nb::arg("loss_scale_device") = nb::none(), nb::arg("stream") = 0)
      .def(
          "combine",
          [](const PyGradientCheckPlan& p, nb::handle partials, int count, nb::handle found_inf,
             nb::handle grad_divisor, nb::handle global_norm, float loss_scale, nb::handle loss_scale_device,
             uintptr_t stream) {
            if (count < 1) throw_argument_error(ErrorCode::invalid_argument, "GradientCheckPlan.combine", "count", "is " +
                                                std::to_string(count) + ", expected at least 1");
            const double* data = scalar_pointer<double>(partials, "partials", "float64", 2 * int64_t{count});
            if (data == nullptr) throw_argument_error(ErrorCode::invalid_argument, "GradientCheckPlan.combine", "partials", "is None, "
                                                      "expected the lists' partials (float64, 2 * count)");
            GradientCheckOutputs out;
            out.found_inf = flag_pointer(found_inf, "found_inf");
            out.grad_divisor = scalar_pointer<float>(grad_divisor, "grad_divisor", "float32");
            out.global_norm = scalar_pointer<float>(global_norm, "global_norm", "float32");
            p.plan.combine(data, count, out, loss_scale,
                           scalar_pointer<float>(loss_scale_device, "loss_scale_device", "float32"), to_stream(stream));
          },
          nb::arg("partials"), nb::arg("count"), nb::arg("found_inf") = nb::none(), nb::arg("grad_divisor") = nb::none(),
          nb::arg("global_norm") = nb::none(), nb::arg("loss_scale") = 1.0f, nb::arg("loss_scale_device") = nb::none(),
          nb::arg("stream") = 0,
          "The outputs of one check over several lists (the ranks' shards of one model) from their partials "
          "(check(partial=...), `count` of them, one after another), combined in index order.")
      .def("set_grads",
           [](PyGradientCheckPlan& p, const Arrays& g, bool hold, uintptr_t stream) { set_grads(p.grads, p.plan, g, hold, stream); },
           nb::arg("grads"), nb::arg("hold_grads") = true, nb::arg("stream") = 0);
}

}  // namespace gradkit::python
