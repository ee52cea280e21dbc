// Public Muon entry points: validate every input, group the matrices into
// batches of one shape and one group, and run each batch's passes.
#include "gradkit/ops/muon.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>

#include "spec/muon.h"
#include "spec/muon_math.h"
#include "gradkit/core/error.h"
#include "ops/device_scalar.h"
#include "ops/muon_common.h"

namespace gradkit {
namespace muon_detail {

void check_dtypes(std::string_view op, const MultiTensorPlan& plan) {
  const auto expect = [&](DType got, std::initializer_list<DType> allowed, std::string_view list,
                          std::string_view expected) {
    if (std::find(allowed.begin(), allowed.end(), got) == allowed.end()) {
      throw_argument_error(ErrorCode::dtype_unsupported, op, list,
                           "has dtype " + std::string(dtype_name(got)) + ", expected " + std::string(expected));
    }
  };
  expect(plan.dtype(0), {DType::f32, DType::bf16}, "params", "f32 or bf16");
  expect(plan.dtype(1), {DType::f32, DType::f16, DType::bf16}, "grads", "f32, f16 or bf16");
  expect(plan.dtype(2), {DType::f32, DType::bf16}, "momentum", "f32 or bf16");
}

void check_shape(std::string_view op, size_t i, const MatrixShape& s, int64_t numel) {
  if (s.batch < 1 || s.rows < 1 || s.cols < 1) {
    throw_argument_error(ErrorCode::invalid_argument, op, indexed("shapes", i),
                         "is (" + std::to_string(s.batch) + ", " + std::to_string(s.rows) + ", " +
                             std::to_string(s.cols) + "); expected batch, rows and cols each >= 1");
  }
  // rows * cols first, each bounded by numel, so that no product overflows.
  const bool fits = s.rows <= numel && s.cols <= numel / s.rows && s.batch <= numel / (s.rows * s.cols);
  if (!fits || s.batch * s.rows * s.cols != numel) {
    throw_argument_error(ErrorCode::size_mismatch, op, indexed("shapes", i),
                         "is (" + std::to_string(s.batch) + ", " + std::to_string(s.rows) + ", " +
                             std::to_string(s.cols) + "), expected batch * rows * cols = the tensor's " +
                             std::to_string(numel) + " elements");
  }
}

void check_second_moment(std::string_view op, std::span<const TensorView> second_moment,
                         std::span<const TensorView> params, std::span<const MatrixShape> shapes,
                         std::span<const MuonHyperparameters> hyperparameters, std::span<const int32_t> groups) {
  if (second_moment.empty()) {
    for (size_t i = 0; i < params.size(); ++i) {
      const size_t group = groups.empty() ? 0 : static_cast<size_t>(groups[i]);
      if (hyperparameters[group].second_moment) {
        throw_argument_error(ErrorCode::invalid_argument, op, "second_moment",
                             "is empty, but hyperparameters[" + std::to_string(group) +
                                 "].second_moment is set; expected one f32 tensor per parameter");
      }
    }
    return;
  }
  if (second_moment.size() != params.size()) {
    throw_argument_error(ErrorCode::size_mismatch, op, "second_moment",
                         "has " + std::to_string(second_moment.size()) + " tensors, expected one per parameter (" +
                             std::to_string(params.size()) + ")");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorView& v = second_moment[i];
    const int64_t expected = muon_second_moment_numel(shapes[i]);
    if (v.dtype != DType::f32) {
      throw_argument_error(ErrorCode::dtype_unsupported, op, indexed("second_moment", i),
                           "has dtype " + std::string(dtype_name(v.dtype)) + ", expected f32");
    }
    if (v.numel != expected) {
      throw_argument_error(ErrorCode::size_mismatch, op, indexed("second_moment", i),
                           "has " + std::to_string(v.numel) + " elements, expected " + std::to_string(expected) +
                               " (one per row where rows >= cols, else per column, of each matrix)");
    }
    if (v.data == nullptr) {
      throw_argument_error(ErrorCode::null_pointer, op, indexed("second_moment", i), "is null");
    }
    if (!(v.device == params[i].device)) {
      throw_argument_error(ErrorCode::device_mismatch, op, indexed("second_moment", i),
                           "is on " + to_string(v.device) + ", expected the parameters' " +
                               to_string(params[i].device));
    }
  }
}

void check_sharded_recipe(const MuonHyperparameters& h, std::string_view op, const std::string& arg) {
  if (h.renormalize || h.second_moment) {
    throw_argument_error(ErrorCode::invalid_argument, op, arg + (h.renormalize ? ".renormalize" : ".second_moment"),
                         "is set; the sharded plan takes ns_coefficients, divisor, equilibrate_rows and "
                         "cautious_weight_decay, not the result's scales (Muon+, NorMuon): use MuonPlan on whole "
                         "matrices for those");
  }
}

void check_step_inputs(std::string_view op, const MuonStepInputs& in, Device device) {
  ops::check_device_scalar(op, "found_inf", in.found_inf, device);
  ops::check_device_scalar(op, "grad_scale_device", in.grad_scale_device, device);
  if (in.grad_scale_device == nullptr) {
    check_value(std::isfinite(in.grad_scale) && in.grad_scale > 0, op, "grad_scale", in.grad_scale,
                "a finite value > 0");
  }
}

std::vector<MatrixBatch> batch_matrices(std::span<const MatrixShape> shapes, std::span<const int32_t> groups,
                                        std::span<const int32_t> owners) {
  std::vector<MatrixBatch> batches;
  std::map<std::tuple<int64_t, int64_t, int32_t, int32_t>, size_t> open;  // the batch each key is filling
  size_t matrix = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const MatrixShape& s = shapes[i];
    const int32_t group = groups.empty() ? 0 : groups[i];
    for (int64_t m = 0; m < s.batch; ++m, ++matrix) {
      const int32_t owner = owners.empty() ? 0 : owners[matrix];
      const auto key = std::make_tuple(s.rows, s.cols, group, owner);
      auto it = open.find(key);
      if (it == open.end() ||
          static_cast<int64_t>(batches[it->second].sources.size() + 1) * s.rows * s.cols > kMaxBatchElements) {
        batches.push_back(MatrixBatch{s.rows, s.cols, group, owner, {}});
        it = open.insert_or_assign(key, batches.size() - 1).first;
      }
      batches[it->second].sources.emplace_back(static_cast<int32_t>(i), m);
    }
  }
  return batches;
}

Concurrency plan_concurrency(Device device, std::span<const size_t> batch_bytes, int32_t streams) {
  Concurrency c;
  size_t largest = 0, together = 0;
  std::vector<size_t> offsets;
  for (const size_t bytes : batch_bytes) {
    largest = std::max(largest, bytes);
    offsets.push_back(together);
    together += (bytes + 255) / 256 * 256;
  }
  c.workspace = largest;
  // Small batches at once on side streams, each in a workspace of its own.
  if (device.is_cuda() && streams > 1 && batch_bytes.size() > 1 && together <= kConcurrentWorkspace) {
    c.offsets = std::move(offsets);
    c.lanes = static_cast<int>(std::min<size_t>(static_cast<size_t>(streams), batch_bytes.size()));
    c.workspace = together;
  }
  return c;
}

}  // namespace muon_detail

namespace {

using namespace muon_detail;

constexpr std::string_view kOp = "muon_step";

// The views of a batch's matrices in one list of whole tensors.
std::vector<TensorView> batch_views(const MuonPlan::Batch& b, std::span<const TensorView> tensors) {
  std::vector<TensorView> views;
  views.reserve(b.sources.size());
  const int64_t elements = b.rows * b.cols;
  for (const auto& [tensor, m] : b.sources) views.push_back(slice(tensors[static_cast<size_t>(tensor)], m * elements, elements));
  return views;
}

}  // namespace

void validate(const MuonHyperparameters& h, std::string_view op, const std::string& arg) {
  check_value(std::isfinite(h.lr) && h.lr >= 0, op, arg + ".lr", h.lr, "a finite value >= 0");
  check_value(std::isfinite(h.weight_decay) && h.weight_decay >= 0, op, arg + ".weight_decay", h.weight_decay,
              "a finite value >= 0");
  check_value(h.momentum >= 0 && h.momentum < 1, op, arg + ".momentum", h.momentum, "a value in [0, 1)");
  check_value(std::isfinite(h.eps) && h.eps > 0, op, arg + ".eps", h.eps, "a finite value > 0");
  check_value(h.ns_coefficient_count >= 1 && h.ns_coefficient_count <= kMuonMaxNsCoefficients, op,
              arg + ".ns_coefficient_count", h.ns_coefficient_count,
              "a count in [1, " + std::to_string(kMuonMaxNsCoefficients) + "]");
  for (int32_t i = 0; i < h.ns_coefficient_count; ++i) {
    const MuonNsCoefficients& k = h.ns_coefficients[i];
    const std::string at = arg + ".ns_coefficients[" + std::to_string(i) + "]";
    check_value(std::isfinite(k.a), op, at + ".a", k.a, "a finite coefficient");
    check_value(std::isfinite(k.b), op, at + ".b", k.b, "a finite coefficient");
    check_value(std::isfinite(k.c), op, at + ".c", k.c, "a finite coefficient");
  }
  check_value(h.ns_steps >= 1 && h.ns_steps < 100, op, arg + ".ns_steps", h.ns_steps, "a count in [1, 100)");
  check_value(h.adjust_lr == MuonLrAdjust::original || h.adjust_lr == MuonLrAdjust::match_rms_adamw, op,
              arg + ".adjust_lr", static_cast<double>(h.adjust_lr), "original (0) or match_rms_adamw (1)");
  check_value(h.divisor == MuonDivisor::clamp || h.divisor == MuonDivisor::polar_express, op, arg + ".divisor",
              static_cast<double>(h.divisor), "clamp (0) or polar_express (1)");
  check_value(h.beta2 >= 0 && h.beta2 < 1, op, arg + ".beta2", h.beta2, "a value in [0, 1)");
}

void MuonHyperparameters::set_ns_coefficients(std::span<const MuonNsCoefficients> triples) {
  if (triples.empty() || triples.size() > static_cast<size_t>(kMuonMaxNsCoefficients)) {
    throw_argument_error(ErrorCode::invalid_argument, "MuonHyperparameters", "ns_coefficients",
                         "has " + std::to_string(triples.size()) + " triples, expected 1 to " +
                             std::to_string(kMuonMaxNsCoefficients));
  }
  std::copy(triples.begin(), triples.end(), ns_coefficients);
  ns_coefficient_count = static_cast<int32_t>(triples.size());
}

double muon_adjusted_lr(const MuonHyperparameters& h, int64_t rows, int64_t cols) {
  return h.lr * spec::muon_lr_ratio(h, rows, cols);
}

MuonPlan::MuonPlan(const MuonTensors& t, std::span<const MuonHyperparameters> hyperparameters,
                   std::span<const int32_t> groups, MuonPlanOptions options)
    : options_(options) {
  if (hyperparameters.empty()) {
    throw_argument_error(ErrorCode::invalid_argument, kOp, "hyperparameters", "is empty; expected one entry per group");
  }
  for (size_t i = 0; i < hyperparameters.size(); ++i) validate(hyperparameters[i], kOp, indexed("hyperparameters", i));
  check_value(options.streams >= 1, kOp, "options.streams", options.streams, "a count >= 1");
  if (t.shapes.size() != t.params.size()) {
    throw_argument_error(ErrorCode::size_mismatch, kOp, "shapes",
                         "has " + std::to_string(t.shapes.size()) + " entries, expected one per parameter (" +
                             std::to_string(t.params.size()) + ")");
  }
  const std::vector<PlanList> lists = {{"params", t.params, true}, {"grads", t.grads, false},
                                       {"momentum", t.momentum, true}};
  all_ = MultiTensorPlan(kOp, lists, MultiTensorPlan::kDefaultChunkElements, groups,
                         static_cast<int32_t>(hyperparameters.size()));
  if (!all_.empty()) check_dtypes(kOp, all_);
  for (size_t i = 0; i < t.params.size(); ++i) check_shape(kOp, i, t.shapes[i], t.params[i].numel);
  check_second_moment(kOp, t.second_moment, t.params, t.shapes, hyperparameters, groups);

  // Matrices of one shape and one group, in tensor order, make a batch (up
  // to kMaxBatchElements): its products run as one batched call each.
  for (MatrixBatch& b : batch_matrices(t.shapes, groups, {})) {
    batches_.push_back(Batch{{}, 0, b.rows, b.cols, b.group, std::move(b.sources)});
  }
  std::vector<size_t> bytes;
  for (Batch& batch : batches_) {
    const std::vector<TensorView> params = batch_views(batch, t.params), grads = batch_views(batch, t.grads),
                                  momentum = batch_views(batch, t.momentum);
    const std::vector<PlanList> batch_lists = {{"params", params, true}, {"grads", grads, false},
                                               {"momentum", momentum, true}};
    batch.plan = MultiTensorPlan(kOp, batch_lists);
    batch.count = static_cast<int64_t>(batch.sources.size());
    bytes.push_back(device().is_cuda() ? spec::muon_cuda_workspace_bytes(batch)
                                       : spec::muon_cpu_workspace_bytes(batch));
  }
  // Each batch's matrices' second moments, as a pointer table on the device.
  if (!t.second_moment.empty()) {
    std::vector<float*> pointers;
    for (const Batch& batch : batches_) {
      for (const auto& [tensor, m] : batch.sources) {
        const TensorView& v = t.second_moment[static_cast<size_t>(tensor)];
        const MatrixShape& shape = t.shapes[static_cast<size_t>(tensor)];
        pointers.push_back(static_cast<float*>(v.data) + m * std::max(shape.rows, shape.cols));
      }
    }
    second_moment_table_ = Buffer(device(), pointers.size() * sizeof(float*));
    copy_from_host(second_moment_table_.data(), device(), pointers.data(), pointers.size() * sizeof(float*));
    auto* table = static_cast<float* const*>(second_moment_table_.data());
    for (Batch& batch : batches_) {
      batch.second_moment = table;
      table += batch.count;
    }
  }
  Concurrency together = plan_concurrency(device(), bytes, options.streams);
  offsets_ = std::move(together.offsets);
  lanes_ = together.lanes;
  const size_t workspace = together.workspace;
  if (device().is_cuda()) gemm_ = spec::muon_cuda_gemm(device(), lanes_);
  workspace_ = Buffer(device(), workspace);
  hyper_.set(kOp, hyperparameters, device());
  if (device().is_cuda()) spec::muon_cuda_prepare(gemm_.get(), launches({}));
}

std::vector<spec::MuonLaunch> MuonPlan::launches(const MuonStepInputs& in) const {
  std::vector<spec::MuonLaunch> out;
  for (size_t b = 0; b < batches_.size(); ++b) {
    const Batch& batch = batches_[b];
    const auto group = static_cast<size_t>(batch.group);
    spec::MuonLaunch launch{&batch,        &hyper_.host()[group],
                               hyper_.on(device()) + group,
                               workspace_.data(), gemm_.get(),
                               in.found_inf,  in.grad_scale,
                               in.grad_scale_device, options_.split_from};
    if (!offsets_.empty()) {  // at once on the side streams
      launch.workspace = static_cast<unsigned char*>(workspace_.data()) + offsets_[b];
      launch.lane = static_cast<int>(b % static_cast<size_t>(lanes_));
    }
    out.push_back(launch);
  }
  return out;
}

// NorMuon reads each matrix's second moment: a group may turn it on only
// where the plan was given them.
void MuonPlan::check_second_moment_given(std::span<const MuonHyperparameters> hyperparameters) const {
  if (second_moment_table_.bytes() != 0) return;
  for (size_t g = 0; g < hyperparameters.size(); ++g) {
    if (hyperparameters[g].second_moment) {
      throw_argument_error(ErrorCode::invalid_argument, kOp, indexed("hyperparameters", g) + ".second_moment",
                           "is set, but the plan was made without second_moment tensors; expected a plan made "
                           "with MuonTensors::second_moment");
    }
  }
}

void MuonPlan::set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters) {
  check_second_moment_given(hyperparameters);
  hyper_.set(kOp, hyperparameters, device());  // checks the count and each entry first
}

void MuonPlan::set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters, Stream stream) {
  check_second_moment_given(hyperparameters);
  hyper_.set_on(kOp, hyperparameters, device(), stream);
}

void MuonPlan::set_grads(std::span<const TensorView> grads, Stream stream) {
  all_.repoint(1, grads, stream);  // every check, before any batch changes
  for (Batch& b : batches_) b.plan.repoint(1, batch_views(b, grads), stream);
}

void MuonPlan::validate_inputs(const MuonStepInputs& in) const { check_step_inputs(kOp, in, device()); }

void MuonPlan::step(const MuonStepInputs& in, Stream stream) const {
  validate_inputs(in);
  const std::vector<spec::MuonLaunch> all = launches(in);
  if (device().is_cuda()) {
    spec::muon_cuda_step(gemm_.get(), all, !offsets_.empty(), options_.graphs, stream);
  } else {
    for (const spec::MuonLaunch& launch : all) spec::muon_cpu(launch);
  }
}

void muon_step(const MuonTensors& tensors, const MuonHyperparameters& hyperparameters, const MuonStepInputs& inputs,
               Stream stream) {
  MuonPlan(tensors, std::span(&hyperparameters, 1)).step(inputs, stream);
}

}  // namespace gradkit
