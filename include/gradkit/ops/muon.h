// Muon (momentum orthogonalised by Newton-Schulz; torch.optim.Muon's
// semantics) over lists of matrices: the element-wise parts fused, the
// Newton-Schulz products batched over matrices of one shape.
// docs/ops.md ("muon_step") states exactly what it computes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

namespace spec {
struct MuonLaunch;  // src/spec/muon.h
}

// How the learning rate is scaled by each matrix's shape (rows A, columns B):
// original (Keller Jordan's): sqrt(max(1, A / B)); match_rms_adamw
// (Moonshot's): 0.2 sqrt(max(A, B)).
enum class MuonLrAdjust : int32_t { original = 0, match_rms_adamw = 1 };

// What the Newton-Schulz input is divided by (n: its Frobenius norm, in bf16):
// clamp: max(n, eps), torch.optim.Muon's; polar_express: 1.01 n + eps, the
// safety margin Polar Express's coefficients are computed for (arXiv
// 2505.16932, as nanochat's MuonAdamW runs it).
enum class MuonDivisor : int32_t { clamp = 0, polar_express = 1 };

// One Newton-Schulz iteration's coefficients: X' = a X + (b A + c A A) X, A = X Xt.
struct MuonNsCoefficients {
  float a, b, c;
};

// The most per-iteration triples a group holds; iterations past the last
// triple repeat it.
inline constexpr int32_t kMuonMaxNsCoefficients = 8;

// Polar Express's five triples (arXiv 2505.16932; computed for 5 iterations,
// safety factor 2e-2, cushion 2), as f32.
inline constexpr MuonNsCoefficients kPolarExpressCoefficients[5] = {
    {8.156554524902461f, -22.48329292557795f, 15.878769915207462f},
    {4.042929935166739f, -2.808917465908714f, 0.5000178451051316f},
    {3.8916678022926607f, -2.772484153217685f, 0.5060648178503393f},
    {3.285753657755655f, -2.3681294933425376f, 0.46449024233003106f},
    {2.3465413258596377f, -1.7097828382687081f, 0.42323551169305323f},
};

// One group's hyperparameters, torch.optim.Muon's defaults. The recipe's
// parts (divisor, equilibrate_rows, renormalize, second_moment,
// cautious_weight_decay) are off by default, so that the default step is
// torch.optim.Muon's; docs/ops.md ("muon_step") gives each one's formula.
struct MuonHyperparameters {
  double lr = 1e-3;
  double weight_decay = 0.1;
  double momentum = 0.95;
  bool nesterov = true;
  // Iteration s uses ns_coefficients[min(s, ns_coefficient_count - 1)]:
  // one triple is torch's fixed quintic iteration.
  MuonNsCoefficients ns_coefficients[kMuonMaxNsCoefficients] = {{3.4445f, -4.7750f, 2.0315f}};
  int32_t ns_coefficient_count = 1;
  float eps = 1e-7f;     // the divisor's eps
  int32_t ns_steps = 5;
  MuonLrAdjust adjust_lr = MuonLrAdjust::original;
  MuonDivisor divisor = MuonDivisor::clamp;
  // MuonEq (arXiv 2603.28254): each row of the bf16 input scaled to the
  // matrix's mean row norm before the normalisation.
  bool equilibrate_rows = false;
  // Muon+ (arXiv 2602.21545): the result scaled to a Frobenius norm of
  // sqrt(min(rows, cols)), that of an exactly semi-orthogonal matrix.
  bool renormalize = false;
  // NorMuon (arXiv 2510.05491): a second moment of the result's mean square
  // per row (rows >= cols) or per column (rows < cols), beta2 its EMA
  // weight; the result divided by its square root, then rescaled to the
  // Frobenius norm it had. Needs MuonTensors::second_moment.
  bool second_moment = false;
  double beta2 = 0.95;
  // Cautious weight decay (arXiv 2510.12402): w -= lr' (O + weight_decay w)
  // where O w >= 0, w -= lr' O elsewhere (lr' the adjusted learning rate);
  // without it, w = w (1 - lr weight_decay) - lr' O (torch's).
  bool cautious_weight_decay = false;

  // Sets the per-iteration triples (1 to kMuonMaxNsCoefficients of them).
  void set_ns_coefficients(std::span<const MuonNsCoefficients> triples);
  std::span<const MuonNsCoefficients> ns_coefficient_list() const {
    return {ns_coefficients, static_cast<size_t>(ns_coefficient_count)};
  }
  // Iteration s's triple.
  const MuonNsCoefficients& ns_iteration(int32_t s) const {
    return ns_coefficients[s < ns_coefficient_count ? s : ns_coefficient_count - 1];
  }
};

// Throws Error naming `op` and `arg` unless lr, weight_decay and momentum
// are finite and >= 0 (momentum < 1 too), eps finite and > 0, the
// coefficients finite (1 to kMuonMaxNsCoefficients triples), ns_steps in
// [1, 100), adjust_lr and divisor known values, and beta2 in [0, 1).
void validate(const MuonHyperparameters& h, std::string_view op, const std::string& arg);

}  // namespace gradkit

#include "gradkit/ops/detail/group_table.h"

namespace gradkit {

// A tensor's shape as Muon sees it: `batch` matrices of rows x cols, row
// major, one after another (batch 1 for a plain matrix, the expert count for
// a 3-D stack of experts). batch * rows * cols must be the tensor's numel.
struct MatrixShape {
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
};

// params f32 or bf16; grads f32, f16 or bf16; momentum f32 or bf16. One
// shape per tensor. On CUDA the products are bf16 with f32 accumulation
// (cuBLASLt); on the CPU they are f32 products of the same bf16 values
// (the BLAS), rounded to bf16 as the GPU's are.
struct MuonTensors {
  std::span<const TensorView> params;
  std::span<const TensorView> grads;
  std::span<const TensorView> momentum;  // torch.optim.Muon's momentum_buffer
  std::span<const MatrixShape> shapes;
  // NorMuon's state: f32, one per tensor, of muon_second_moment_numel
  // elements (zeros at first). Required, one per tensor, when a group has
  // second_moment; may be empty otherwise.
  std::span<const TensorView> second_moment = {};
};

// The element count of a tensor's NorMuon second moment: one value per row
// of each matrix (rows >= cols) or per column (rows < cols).
inline int64_t muon_second_moment_numel(const MatrixShape& s) {
  return s.batch * (s.rows >= s.cols ? s.rows : s.cols);
}

// How a plan runs its products (not what they compute).
struct MuonPlanOptions {
  // CUDA: for matrices whose smaller side m is at least this (and 128), the
  // symmetric products (X Xt and A A, A = X Xt) run by row blocks, the
  // lower blocks computed and the upper one mirrored: 3/4 of their
  // multiplications (docs/ops.md, "muon_step"). The CPU computes them whole.
  int64_t split_from = 1024;
  // CUDA: the step is recorded once into a CUDA graph and replayed (one
  // launch instead of a few per batch and product), unless the caller's
  // stream is itself recording one. A new learning rate, weight decay,
  // momentum or eps is read from the plan's table on the device; a new
  // found_inf, grad_scale or Newton-Schulz coefficient records it again.
  bool graphs = true;
  // CUDA: when all the batches' workspaces together take at most 64 MiB
  // (small matrices, whose products fill a fraction of the GPU), the
  // batches run at once on up to this many side streams, each with its own
  // workspace, joined back into the caller's stream. 1: one after another.
  int32_t streams = 4;
  // MuonShardedPlan: its matrices in up to this many buckets, each a run of
  // whole shape classes (one shape, one group: every owner's share of them),
  // balanced by Newton-Schulz FLOPs. Each bucket has its own exchange
  // sections and parts, so that a caller can exchange one bucket while
  // another is being orthogonalised. MuonPlan ignores it.
  int32_t buckets = 1;
};

struct MuonStepInputs {
  const bool* found_inf = nullptr;  // on the plan's device; if *found_inf, the step writes nothing
  float grad_scale = 1.0f;          // gradients are divided by this (a loss scale, a clipping factor)
  const float* grad_scale_device = nullptr;  // the same on the plan's device, read by the kernels
};

class MuonPlan {
 public:
  MuonPlan() = default;
  // `groups` gives each tensor's index into `hyperparameters` (empty: all in
  // group 0). Validates everything; groups the matrices into batches of one
  // shape and one group; allocates the workspace of the largest batch.
  MuonPlan(const MuonTensors& tensors, std::span<const MuonHyperparameters> hyperparameters,
           std::span<const int32_t> groups = {}, MuonPlanOptions options = {});

  void step(const MuonStepInputs& inputs = {}, Stream stream = {}) const;
  void validate_inputs(const MuonStepInputs& inputs) const;
  // Replaces the hyperparameters (same group count). The batches stay. The
  // device table is rewritten synchronously, or with a stream, in order on
  // it (no wait): steps enqueued after it there, replayed ones included, see
  // the new values (a learning-rate schedule that does not stall the device).
  void set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters);
  void set_hyperparameters(std::span<const MuonHyperparameters> hyperparameters, Stream stream);
  // Points the plan at new gradients (the same count, element counts, dtype
  // and device; checked as the constructor checks them, nothing changes if
  // a check fails) with small copies enqueued on `stream`, for frameworks
  // that allocate new gradient tensors each step (MultiTensorPlan::repoint).
  void set_grads(std::span<const TensorView> grads, Stream stream = {});

  Device device() const { return all_.device(); }
  std::span<const MuonHyperparameters> hyperparameters() const { return hyper_.host(); }
  size_t num_tensors() const { return all_.num_tensors(); }
  // Batches (same shape, same group), each run with one product per
  // Newton-Schulz stage whatever its matrix count.
  size_t num_batches() const { return batches_.size(); }
  // Bytes of the workspace the plan holds (the largest batch's matrices in
  // bf16 twice, its two Gram products, the norms' partial sums).
  size_t workspace_bytes() const { return workspace_.bytes(); }

  // A batch: its matrices (views into the tensors, in tensor order), their
  // shape and group. Public for the backends; not part of the stable API.
  struct Batch {
    MultiTensorPlan plan;  // lists params, grads, momentum; one "tensor" per matrix
    int64_t count = 0;     // matrices
    int64_t rows = 0, cols = 0;
    int32_t group = 0;
    std::vector<std::pair<int32_t, int64_t>> sources;  // each matrix's tensor and index within it
    // NorMuon: each matrix's second moment (a table on the plan's device),
    // or null where the tensors have none.
    float* const* second_moment = nullptr;
  };

 private:
  void check_second_moment_given(std::span<const MuonHyperparameters> hyperparameters) const;
  // Each batch's launch of a step (src/spec/muon.h).
  std::vector<spec::MuonLaunch> launches(const MuonStepInputs& inputs) const;

  MultiTensorPlan all_;  // the whole tensors, validated once
  detail::GroupTable<MuonHyperparameters> hyper_;  // host, and on the device for the kernels
  std::vector<Batch> batches_;
  MuonPlanOptions options_;
  std::vector<size_t> offsets_;  // concurrent batches: each one's workspace offset (empty: one after another)
  int lanes_ = 0;                // concurrent batches: side streams
  Buffer workspace_;
  Buffer second_moment_table_;  // the batches' second_moment pointers, one after another
  std::shared_ptr<void> gemm_;  // the CUDA backend's cuBLASLt handle and algorithms (null on the CPU)
};

// One call, planned each time.
void muon_step(const MuonTensors& tensors, const MuonHyperparameters& hyperparameters,
               const MuonStepInputs& inputs = {}, Stream stream = {});

// The learning rate a matrix of rows x cols gets (torch.optim.Muon's
// _adjust_lr, in double).
double muon_adjusted_lr(const MuonHyperparameters& h, int64_t rows, int64_t cols);

}  // namespace gradkit
