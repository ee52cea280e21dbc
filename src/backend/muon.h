// The Muon kernels each backend implements, over a validated MuonPlan: per
// batch (matrices of one shape and one group), the momentum pass, the
// Frobenius normalisation, ns_steps Newton-Schulz iterations and the weight
// update, in that order on one stream (docs/ops.md, "muon_step").
#pragma once

#include <span>

#include "gradkit/ops/muon.h"

namespace gradkit::backend {

struct MuonLaunch {
  const MuonPlan::Batch* batch;
  const MuonHyperparameters* hyper;  // the batch's group (host memory: the products' coefficients)
  const MuonHyperparameters* table;  // the same in the plan's table on its device (the element passes read it)
  void* workspace;                   // the plan's (muon_workspace_bytes of the largest batch)
  const void* gemm = nullptr;        // the CUDA backend's per-plan state (muon_cuda_gemm)
  const bool* found_inf = nullptr;
  float grad_scale = 1.0f;
  const float* grad_scale_device = nullptr;
  int64_t split_from = 0;  // MuonPlanOptions::split_from
  int lane = -1;           // CUDA: the side stream the batch runs on (muon_cuda_fork), or -1: the caller's
};

// The workspace one batch needs on each backend (the plan keeps the largest).
size_t muon_cpu_workspace_bytes(const MuonPlan::Batch& batch);
size_t muon_cuda_workspace_bytes(const MuonPlan::Batch& batch);

void muon_cpu(const MuonLaunch& launch);
// Every batch of a step on CUDA: at once on the side streams (`concurrent`,
// forked from and joined into `stream`) or one after another; recorded into
// a CUDA graph and replayed when `graphs` and `stream` is not recording.
void muon_cuda_step(const void* gemm, std::span<const MuonLaunch> launches, bool concurrent, bool graphs,
                    Stream stream);
// Chooses every product's cuBLASLt algorithm for these launches, launching
// nothing: a plan does it when it is made, so that a step cannot fail
// half-way on a product cuBLASLt has no algorithm for.
void muon_cuda_prepare(const void* gemm, std::span<const MuonLaunch> launches);

// The CUDA backend's per-plan state (a cuBLASLt handle and workspace, and
// `lanes` side streams with a workspace each), made once per plan.
std::shared_ptr<void> muon_cuda_gemm(Device device, int lanes);


}  // namespace gradkit::backend
