// Muon over tensor lists (docs/ops.md, "muon_step"): the hyperparameters and
// the plan, which keeps the arrays it was made from alive.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "gradkit/ops/muon.h"
#include "gradkit/ops/muon_sharded.h"
#include "tensors.h"

namespace gradkit::python {
namespace {

using Arrays = std::vector<Array>;
using Shape = std::tuple<int64_t, int64_t, int64_t>;

struct PyMuonPlan {
  ViewList params, grads, momentum;
  std::vector<MatrixShape> shapes;
  MuonPlan plan;
  PyMuonPlan(const Arrays& p, const Arrays& g, const Arrays& m, const std::vector<Shape>& s,
             const std::vector<MuonHyperparameters>& hyper, const std::vector<int32_t>& groups, bool hold_grads,
             int64_t split_from, int32_t streams, bool graphs)
      : params(to_views(p, "params")),
        grads(to_views(g, "grads")),
        momentum(to_views(m, "momentum")),
        shapes(to_shapes(s)),
        plan({params.views, grads.views, momentum.views, shapes}, hyper, groups, MuonPlanOptions{.split_from = split_from, .graphs = graphs, .streams = streams}) {
    if (!hold_grads) grads.arrays.clear();
  }
  static std::vector<MatrixShape> to_shapes(const std::vector<Shape>& s) {
    std::vector<MatrixShape> out;
    for (const auto& [batch, rows, cols] : s) out.push_back({batch, rows, cols});
    return out;
  }
};

std::vector<MatrixShape> to_shapes(const std::vector<Shape>& s) { return PyMuonPlan::to_shapes(s); }

MuonStepInputs step_inputs(nb::handle found_inf, float grad_scale, nb::handle grad_scale_device) {
  MuonStepInputs in;
  in.found_inf = flag_pointer(found_inf, "found_inf");
  in.grad_scale = grad_scale;
  in.grad_scale_device = scalar_pointer<float>(grad_scale_device, "grad_scale_device", "float32");
  return in;
}

// row_splits: a list per tensor of ranks + 1 row boundaries, flattened.
std::vector<int64_t> flat_splits(const std::vector<std::vector<int64_t>>& splits) {
  std::vector<int64_t> out;
  for (const auto& s : splits) out.insert(out.end(), s.begin(), s.end());
  return out;
}

struct PyMuonShardedPlan {
  ViewList params, grads, momentum;
  std::vector<MatrixShape> shapes;
  std::vector<int64_t> splits;
  MuonShardedPlan plan;
  PyMuonShardedPlan(const Arrays& p, const Arrays& g, const Arrays& m, const std::vector<Shape>& s,
                    const std::vector<std::vector<int64_t>>& row_splits, int32_t rank, int32_t ranks,
                    const std::vector<MuonHyperparameters>& hyper, const std::vector<int32_t>& groups,
                    bool hold_grads, int64_t split_from, int32_t streams, bool graphs, int32_t buckets)
      : params(to_views(p, "params")),
        grads(to_views(g, "grads")),
        momentum(to_views(m, "momentum")),
        shapes(to_shapes(s)),
        splits(flat_splits(row_splits)),
        plan({params.views, grads.views, momentum.views, shapes, splits, rank, ranks}, hyper, groups,
             MuonPlanOptions{.split_from = split_from, .graphs = graphs, .streams = streams, .buckets = buckets}) {
    if (!hold_grads) grads.arrays.clear();
  }
};

// set_grads and set_hyperparameters, which both plans' bindings take alike.
template <class Py>
void bind_repointing(nb::class_<Py>& c) {
  c.def(
       "set_grads",
       [](Py& p, const Arrays& g, bool hold, uintptr_t stream) {
         ViewList next = to_views(g, "grads");
         p.plan.set_grads(next.views, to_stream(stream));
         p.grads = std::move(next);
         if (!hold) p.grads.arrays.clear();
       },
       nb::arg("grads"), nb::arg("hold_grads") = true, nb::arg("stream") = 0)
      .def(
          "set_hyperparameters",
          [](Py& p, const std::vector<MuonHyperparameters>& h, std::optional<uintptr_t> stream) {
            if (stream) p.plan.set_hyperparameters(h, to_stream(*stream));
            else p.plan.set_hyperparameters(h);
          },
          nb::arg("hyperparameters"), nb::arg("stream") = nb::none(),
          "Synchronously, or in order on `stream` without waiting (per-step schedules).");
}

}  // namespace

void bind_muon(nb::module_& m) {
  nb::enum_<MuonLrAdjust>(m, "MuonLrAdjust")
      .value("original", MuonLrAdjust::original)
      .value("match_rms_adamw", MuonLrAdjust::match_rms_adamw);

  nb::class_<MuonHyperparameters>(m, "MuonHyperparameters")
      .def(
          "__init__",
          [](MuonHyperparameters* h, double lr, double weight_decay, double momentum, bool nesterov, float ns_a,
             float ns_b, float ns_c, float eps, int32_t ns_steps, MuonLrAdjust adjust_lr) {
            new (h) MuonHyperparameters{lr, weight_decay, momentum, nesterov, ns_a, ns_b, ns_c, eps, ns_steps, adjust_lr};
          },
          nb::arg("lr") = 1e-3, nb::arg("weight_decay") = 0.1, nb::arg("momentum") = 0.95, nb::arg("nesterov") = true,
          nb::arg("ns_a") = 3.4445f, nb::arg("ns_b") = -4.7750f, nb::arg("ns_c") = 2.0315f, nb::arg("eps") = 1e-7f,
          nb::arg("ns_steps") = 5, nb::arg("adjust_lr") = MuonLrAdjust::original)
      .def_rw("lr", &MuonHyperparameters::lr)
      .def_rw("weight_decay", &MuonHyperparameters::weight_decay)
      .def_rw("momentum", &MuonHyperparameters::momentum)
      .def_rw("nesterov", &MuonHyperparameters::nesterov)
      .def_rw("ns_a", &MuonHyperparameters::ns_a)
      .def_rw("ns_b", &MuonHyperparameters::ns_b)
      .def_rw("ns_c", &MuonHyperparameters::ns_c)
      .def_rw("eps", &MuonHyperparameters::eps)
      .def_rw("ns_steps", &MuonHyperparameters::ns_steps)
      .def_rw("adjust_lr", &MuonHyperparameters::adjust_lr);

  m.def("muon_adjusted_lr", &muon_adjusted_lr, nb::arg("hyperparameters"), nb::arg("rows"), nb::arg("cols"),
        "The learning rate a rows x cols matrix gets (torch.optim.Muon's _adjust_lr).");

  auto plan = nb::class_<PyMuonPlan>(m, "MuonPlan",
                         "Muon over lists of matrices planned once (docs/ops.md, muon_step): shapes[i] = (batch, "
                         "rows, cols) of tensor i; matrices of one shape and group are orthogonalised together.")
      .def(nb::init<const Arrays&, const Arrays&, const Arrays&, const std::vector<Shape>&,
                    const std::vector<MuonHyperparameters>&, const std::vector<int32_t>&, bool, int64_t, int32_t, bool>(),
           nb::arg("params"), nb::arg("grads"), nb::arg("momentum"), nb::arg("shapes"), nb::arg("hyperparameters"),
           nb::arg("groups") = std::vector<int32_t>{}, nb::arg("hold_grads") = true,
           nb::arg("split_from") = MuonPlanOptions{}.split_from, nb::arg("streams") = MuonPlanOptions{}.streams,
           nb::arg("graphs") = MuonPlanOptions{}.graphs,
           "split_from: on CUDA, matrices whose smaller side is at least this compute their symmetric products "
           "by row blocks (3/4 of the multiplications); streams: small batches run at once on up to this many "
           "side streams (1: one after another); graphs: on CUDA, the step is recorded into a CUDA graph and "
           "replayed (docs/ops.md).")
      .def(
          "step",
          [](const PyMuonPlan& p, nb::handle found_inf, float grad_scale, nb::handle grad_scale_device,
             uintptr_t stream) {
            p.plan.step(step_inputs(found_inf, grad_scale, grad_scale_device), to_stream(stream));
          },
          nb::arg("found_inf") = nb::none(), nb::arg("grad_scale") = 1.0f, nb::arg("grad_scale_device") = nb::none(),
          nb::arg("stream") = 0,
          "One update. found_inf: a bool on the plan's device, true skips the whole step; the gradients are "
          "divided by grad_scale (or the float32 at grad_scale_device).")
      .def_prop_ro("num_tensors", [](const PyMuonPlan& p) { return p.plan.num_tensors(); })
      .def_prop_ro("num_batches", [](const PyMuonPlan& p) { return p.plan.num_batches(); })
      .def_prop_ro("workspace_bytes", [](const PyMuonPlan& p) { return p.plan.workspace_bytes(); });
  bind_repointing(plan);

  auto sharded = nb::class_<PyMuonShardedPlan>(
      m, "MuonShardedPlan",
      "Muon over this rank's rows of each tensor (FSDP2's Shard(0); docs/ops.md, muon_step over row shards): "
      "row_splits[i] holds tensor i's ranks + 1 row boundaries (of batch * rows rows). The matrices go in "
      "num_buckets buckets (at most `buckets`). The step is momentum(), for each bucket k an all-to-all from "
      "shard_buffer(k) (shard_counts(k)) into owner_buffer(k) (owner_counts(k)), orthogonalize(), the all-to-alls "
      "back, update(); or each part bucket by bucket (momentum(k), ...), so that exchanges overlap products.")
      .def(nb::init<const Arrays&, const Arrays&, const Arrays&, const std::vector<Shape>&,
                    const std::vector<std::vector<int64_t>>&, int32_t, int32_t, const std::vector<MuonHyperparameters>&,
                    const std::vector<int32_t>&, bool, int64_t, int32_t, bool, int32_t>(),
           nb::arg("params"), nb::arg("grads"), nb::arg("momentum"), nb::arg("shapes"), nb::arg("row_splits"),
           nb::arg("rank"), nb::arg("ranks"), nb::arg("hyperparameters"), nb::arg("groups") = std::vector<int32_t>{},
           nb::arg("hold_grads") = true, nb::arg("split_from") = MuonPlanOptions{}.split_from,
           nb::arg("streams") = MuonPlanOptions{}.streams, nb::arg("graphs") = MuonPlanOptions{}.graphs,
           nb::arg("buckets") = MuonPlanOptions{}.buckets)
      .def(
          "momentum",
          [](const PyMuonShardedPlan& p, std::optional<size_t> bucket, nb::handle found_inf, float grad_scale,
             nb::handle grad_scale_device, uintptr_t stream) {
            const MuonStepInputs in = step_inputs(found_inf, grad_scale, grad_scale_device);
            if (bucket) p.plan.momentum(*bucket, in, to_stream(stream));
            else p.plan.momentum(in, to_stream(stream));
          },
          nb::arg("bucket") = nb::none(), nb::arg("found_inf") = nb::none(), nb::arg("grad_scale") = 1.0f,
          nb::arg("grad_scale_device") = nb::none(), nb::arg("stream") = 0,
          "1. The momentum pass of `bucket`'s matrices (None: every bucket's); this rank's rows of the updates to "
          "shard_buffer(bucket), by owner.")
      .def(
          "orthogonalize",
          [](const PyMuonShardedPlan& p, std::optional<size_t> bucket, nb::handle found_inf, uintptr_t stream) {
            const MuonStepInputs in = step_inputs(found_inf, 1.0f, nb::none());
            if (bucket) p.plan.orthogonalize(*bucket, in, to_stream(stream));
            else p.plan.orthogonalize(in, to_stream(stream));
          },
          nb::arg("bucket") = nb::none(), nb::arg("found_inf") = nb::none(), nb::arg("stream") = 0,
          "2. This rank's matrices of `bucket` (None: every bucket) from owner_buffer, orthogonalised, their rows "
          "back to owner_buffer.")
      .def(
          "orthogonalize_beside",
          [](const PyMuonShardedPlan& p, size_t bucket, nb::handle found_inf, uintptr_t stream) {
            p.plan.orthogonalize_beside(bucket, step_inputs(found_inf, 1.0f, nb::none()), to_stream(stream));
          },
          nb::arg("bucket"), nb::arg("found_inf") = nb::none(), nb::arg("stream") = 0,
          "2'. orthogonalize(bucket) on a side stream of the plan's, started after what `stream` holds; "
          "join(bucket, stream) makes `stream` wait for it (CPU: at once).")
      .def(
          "join", [](const PyMuonShardedPlan& p, size_t bucket, uintptr_t stream) { p.plan.join(bucket, to_stream(stream)); },
          nb::arg("bucket"), nb::arg("stream") = 0,
          "`stream` waits for orthogonalize_beside(bucket)'s products (CPU: nothing to wait for).")
      .def_prop_ro("buckets_at_once", [](const PyMuonShardedPlan& p) { return p.plan.buckets_at_once(); })
      .def(
          "update",
          [](const PyMuonShardedPlan& p, std::optional<size_t> bucket, nb::handle found_inf, uintptr_t stream) {
            const MuonStepInputs in = step_inputs(found_inf, 1.0f, nb::none());
            if (bucket) p.plan.update(*bucket, in, to_stream(stream));
            else p.plan.update(in, to_stream(stream));
          },
          nb::arg("bucket") = nb::none(), nb::arg("found_inf") = nb::none(), nb::arg("stream") = 0,
          "3. The weight update of `bucket`'s rows (None: every bucket's) from shard_buffer.")
      .def_prop_ro("num_buckets", [](const PyMuonShardedPlan& p) { return p.plan.num_buckets(); })
      .def(
          "shard_buffer",
          [](nb::handle self, size_t bucket) {
            return to_array(nb::cast<PyMuonShardedPlan&>(self).plan.shard_buffer(bucket), self);
          },
          nb::arg("bucket"), "This rank's rows of the bucket's updates, by owner rank (bf16, 1-D; the plan's memory).")
      .def(
          "owner_buffer",
          [](nb::handle self, size_t bucket) {
            return to_array(nb::cast<PyMuonShardedPlan&>(self).plan.owner_buffer(bucket), self);
          },
          nb::arg("bucket"),
          "Every rank's rows of this rank's matrices of the bucket, by rank (bf16, 1-D; the plan's memory).")
      .def(
          "shard_counts",
          [](const PyMuonShardedPlan& p, size_t bucket) {
            const auto c = p.plan.shard_counts(bucket);
            return std::vector<int64_t>(c.begin(), c.end());
          },
          nb::arg("bucket"))
      .def(
          "owner_counts",
          [](const PyMuonShardedPlan& p, size_t bucket) {
            const auto c = p.plan.owner_counts(bucket);
            return std::vector<int64_t>(c.begin(), c.end());
          },
          nb::arg("bucket"))
      .def("bucket_flops", [](const PyMuonShardedPlan& p, size_t bucket) { return p.plan.bucket_flops(bucket); },
           nb::arg("bucket"))
      .def("bucket", [](const PyMuonShardedPlan& p, size_t tensor, int64_t matrix) { return p.plan.bucket(tensor, matrix); },
           nb::arg("tensor"), nb::arg("matrix") = 0)
      .def("owner", [](const PyMuonShardedPlan& p, size_t tensor, int64_t matrix) { return p.plan.owner(tensor, matrix); },
           nb::arg("tensor"), nb::arg("matrix") = 0)
      .def_prop_ro("owned_flops", [](const PyMuonShardedPlan& p) { return p.plan.owned_flops(); })
      .def_prop_ro("num_owned_batches", [](const PyMuonShardedPlan& p) { return p.plan.num_owned_batches(); })
      .def_prop_ro("workspace_bytes", [](const PyMuonShardedPlan& p) { return p.plan.workspace_bytes(); });
  bind_repointing(sharded);
}

}  // namespace gradkit::python
