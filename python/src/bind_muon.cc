// Muon over tensor lists (docs/ops.md, "muon_step"): the hyperparameters and
// the plan, which keeps the arrays it was made from alive.
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
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
  ViewList params, grads, momentum, second_moment;
  std::vector<MatrixShape> shapes;
  MuonPlan plan;
  PyMuonPlan(const Arrays& p, const Arrays& g, const Arrays& m, const std::vector<Shape>& s,
             const std::vector<MuonHyperparameters>& hyper, const std::vector<int32_t>& groups, bool hold_grads,
             int64_t split_from, int32_t streams, bool graphs, const Arrays& v)
      : params(to_views(p, "params")),
        grads(to_views(g, "grads")),
        momentum(to_views(m, "momentum")),
        second_moment(to_views(v, "second_moment")),
        shapes(to_shapes(s)),
        plan({params.views, grads.views, momentum.views, shapes, second_moment.views}, hyper, groups,
             MuonPlanOptions{.split_from = split_from, .graphs = graphs, .streams = streams}) {
    if (!hold_grads) grads.arrays.clear();
  }
  static std::vector<MatrixShape> to_shapes(const std::vector<Shape>& s) {
    std::vector<MatrixShape> out;
    for (const auto& [batch, rows, cols] : s) out.push_back({batch, rows, cols});
    return out;
  }
};

std::vector<MatrixShape> to_shapes(const std::vector<Shape>& s) { return PyMuonPlan::to_shapes(s); }

using Triple = std::tuple<float, float, float>;

void set_triples(MuonHyperparameters& h, const std::vector<Triple>& triples) {
  std::vector<MuonNsCoefficients> k;
  for (const auto& [a, b, c] : triples) k.push_back({a, b, c});
  h.set_ns_coefficients(k);
}

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

// blocks: a list per tensor of one (batch_first, batches, row_first, rows,
// col_first, cols) per rank, flattened.
using BlockRow = std::array<int64_t, 6>;
std::vector<MatrixBlock> flat_blocks(const std::vector<std::vector<BlockRow>>& blocks) {
  std::vector<MatrixBlock> out;
  for (const auto& tensor : blocks) {
    for (const BlockRow& b : tensor) out.push_back({b[0], b[1], b[2], b[3], b[4], b[5]});
  }
  return out;
}

struct PyMuonShardedPlan {
  ViewList params, grads, momentum;
  std::vector<MatrixShape> shapes;
  std::vector<int64_t> splits;
  std::vector<MatrixBlock> blocks;
  MuonShardedPlan plan;
  PyMuonShardedPlan(const Arrays& p, const Arrays& g, const Arrays& m, const std::vector<Shape>& s,
                    const std::vector<std::vector<int64_t>>& row_splits, int32_t rank, int32_t ranks,
                    const std::vector<MuonHyperparameters>& hyper, const std::vector<int32_t>& groups,
                    bool hold_grads, int64_t split_from, int32_t streams, bool graphs, int32_t buckets,
                    const std::vector<std::vector<BlockRow>>& block_rows)
      : params(to_views(p, "params")),
        grads(to_views(g, "grads")),
        momentum(to_views(m, "momentum")),
        shapes(to_shapes(s)),
        splits(flat_splits(row_splits)),
        blocks(flat_blocks(block_rows)),
        plan({params.views, grads.views, momentum.views, shapes, splits, rank, ranks, blocks}, hyper, groups,
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

  nb::enum_<MuonDivisor>(m, "MuonDivisor")
      .value("clamp", MuonDivisor::clamp)
      .value("polar_express", MuonDivisor::polar_express);

  m.attr("polar_express_coefficients") = [] {
    std::vector<Triple> out;
    for (const MuonNsCoefficients& k : kPolarExpressCoefficients) out.emplace_back(k.a, k.b, k.c);
    return out;
  }();

  nb::class_<MuonHyperparameters>(m, "MuonHyperparameters")
      .def(
          "__init__",
          [](MuonHyperparameters* h, double lr, double weight_decay, double momentum, bool nesterov,
             const std::vector<Triple>& ns_coefficients, float eps, int32_t ns_steps, MuonLrAdjust adjust_lr,
             MuonDivisor divisor, bool equilibrate_rows, bool renormalize, bool second_moment, double beta2,
             bool cautious_weight_decay) {
            MuonHyperparameters out;
            out.lr = lr;
            out.weight_decay = weight_decay;
            out.momentum = momentum;
            out.nesterov = nesterov;
            set_triples(out, ns_coefficients);
            out.eps = eps;
            out.ns_steps = ns_steps;
            out.adjust_lr = adjust_lr;
            out.divisor = divisor;
            out.equilibrate_rows = equilibrate_rows;
            out.renormalize = renormalize;
            out.second_moment = second_moment;
            out.beta2 = beta2;
            out.cautious_weight_decay = cautious_weight_decay;
            new (h) MuonHyperparameters(out);
          },
          nb::arg("lr") = 1e-3, nb::arg("weight_decay") = 0.1, nb::arg("momentum") = 0.95, nb::arg("nesterov") = true,
          nb::arg("ns_coefficients") = std::vector<Triple>{{3.4445f, -4.7750f, 2.0315f}}, nb::arg("eps") = 1e-7f,
          nb::arg("ns_steps") = 5, nb::arg("adjust_lr") = MuonLrAdjust::original,
          nb::arg("divisor") = MuonDivisor::clamp, nb::arg("equilibrate_rows") = false,
          nb::arg("renormalize") = false, nb::arg("second_moment") = false, nb::arg("beta2") = 0.95,
          nb::arg("cautious_weight_decay") = false,
          "ns_coefficients: one (a, b, c) triple per Newton-Schulz iteration (1 to 8; iterations past the last "
          "repeat it). The recipe's parts (divisor, equilibrate_rows, renormalize, second_moment with beta2, "
          "cautious_weight_decay) are off by default: torch.optim.Muon's step (docs/ops.md, muon_step).")
      .def_rw("lr", &MuonHyperparameters::lr)
      .def_rw("weight_decay", &MuonHyperparameters::weight_decay)
      .def_rw("momentum", &MuonHyperparameters::momentum)
      .def_rw("nesterov", &MuonHyperparameters::nesterov)
      .def_prop_rw(
          "ns_coefficients",
          [](const MuonHyperparameters& h) {
            std::vector<Triple> out;
            for (const MuonNsCoefficients& k : h.ns_coefficient_list()) out.emplace_back(k.a, k.b, k.c);
            return out;
          },
          [](MuonHyperparameters& h, const std::vector<Triple>& t) { set_triples(h, t); })
      .def_rw("eps", &MuonHyperparameters::eps)
      .def_rw("ns_steps", &MuonHyperparameters::ns_steps)
      .def_rw("adjust_lr", &MuonHyperparameters::adjust_lr)
      .def_rw("divisor", &MuonHyperparameters::divisor)
      .def_rw("equilibrate_rows", &MuonHyperparameters::equilibrate_rows)
      .def_rw("renormalize", &MuonHyperparameters::renormalize)
      .def_rw("second_moment", &MuonHyperparameters::second_moment)
      .def_rw("beta2", &MuonHyperparameters::beta2)
      .def_rw("cautious_weight_decay", &MuonHyperparameters::cautious_weight_decay);

  m.def("muon_second_moment_numel",
        [](int64_t batch, int64_t rows, int64_t cols) { return muon_second_moment_numel({batch, rows, cols}); },
        nb::arg("batch"), nb::arg("rows"), nb::arg("cols"),
        "Elements of a (batch, rows, cols) tensor's NorMuon second moment: one per row of each matrix where rows "
        ">= cols, else one per column.");

  m.def("muon_adjusted_lr", &muon_adjusted_lr, nb::arg("hyperparameters"), nb::arg("rows"), nb::arg("cols"),
        "The learning rate a rows x cols matrix gets (torch.optim.Muon's _adjust_lr).");

  auto plan = nb::class_<PyMuonPlan>(m, "MuonPlan",
                         "Muon over lists of matrices planned once (docs/ops.md, muon_step): shapes[i] = (batch, "
                         "rows, cols) of tensor i; matrices of one shape and group are orthogonalised together.")
      .def(nb::init<const Arrays&, const Arrays&, const Arrays&, const std::vector<Shape>&,
                    const std::vector<MuonHyperparameters>&, const std::vector<int32_t>&, bool, int64_t, int32_t, bool,
                    const Arrays&>(),
           nb::arg("params"), nb::arg("grads"), nb::arg("momentum"), nb::arg("shapes"), nb::arg("hyperparameters"),
           nb::arg("groups") = std::vector<int32_t>{}, nb::arg("hold_grads") = true,
           nb::arg("split_from") = MuonPlanOptions{}.split_from, nb::arg("streams") = MuonPlanOptions{}.streams,
           nb::arg("graphs") = MuonPlanOptions{}.graphs, nb::arg("second_moment") = Arrays{},
           "split_from: on CUDA, matrices whose smaller side is at least this compute their symmetric products "
           "by row blocks (3/4 of the multiplications); streams: small batches run at once on up to this many "
           "side streams (1: one after another); graphs: on CUDA, the step is recorded into a CUDA graph and "
           "replayed (docs/ops.md); second_moment: NorMuon's state, one float32 tensor per param of "
           "muon_second_moment_numel elements (required where a group has second_moment).")
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
      "Muon over this rank's piece of each tensor (docs/ops.md, muon_step over shards): row_splits[i] holds "
      "tensor i's ranks + 1 row boundaries (of batch * rows rows: FSDP2's Shard(0)), or (row_splits empty) "
      "blocks[i] its ranks' blocks, each (batch_first, batches, row_first, rows, col_first, cols): any Shard "
      "placements on any mesh, this rank's shard the block row-major. The matrices go in "
      "num_buckets buckets (at most `buckets`). The step is momentum(), for each bucket k an all-to-all from "
      "shard_buffer(k) (shard_counts(k)) into owner_buffer(k) (owner_counts(k)), orthogonalize(), the all-to-alls "
      "back, update(); or each part bucket by bucket (momentum(k), ...), so that exchanges overlap products.")
      .def(nb::init<const Arrays&, const Arrays&, const Arrays&, const std::vector<Shape>&,
                    const std::vector<std::vector<int64_t>>&, int32_t, int32_t, const std::vector<MuonHyperparameters>&,
                    const std::vector<int32_t>&, bool, int64_t, int32_t, bool, int32_t,
                    const std::vector<std::vector<BlockRow>>&>(),
           nb::arg("params"), nb::arg("grads"), nb::arg("momentum"), nb::arg("shapes"), nb::arg("row_splits"),
           nb::arg("rank"), nb::arg("ranks"), nb::arg("hyperparameters"), nb::arg("groups") = std::vector<int32_t>{},
           nb::arg("hold_grads") = true, nb::arg("split_from") = MuonPlanOptions{}.split_from,
           nb::arg("streams") = MuonPlanOptions{}.streams, nb::arg("graphs") = MuonPlanOptions{}.graphs,
           nb::arg("buckets") = MuonPlanOptions{}.buckets, nb::arg("blocks") = std::vector<std::vector<BlockRow>>{})
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
