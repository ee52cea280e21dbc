// The Muon kernels each backend implements, over a validated MuonPlan: per
// batch (matrices of one shape and one group), the momentum pass, the
// Frobenius normalisation, ns_steps Newton-Schulz iterations and the weight
// update, in that order on one stream (docs/ops.md, "muon_step").
#pragma once

#include "gradkit/ops/muon.h"

namespace gradkit::backend {

struct MuonLaunch {
  const MuonPlan::Batch* batch;
  const MuonHyperparameters* hyper;  // the batch's group
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
void muon_cuda(const MuonLaunch& launch, Stream stream);

// The CUDA backend's per-plan state (a cuBLASLt handle and workspace, and
// `lanes` side streams with a workspace each), made once per plan.
std::shared_ptr<void> muon_cuda_gemm(Device device, int lanes);
// Starts the side streams after the work enqueued on `stream`; makes
// `stream` wait for what they were given.
void muon_cuda_fork(const void* gemm, Stream stream);
void muon_cuda_join(const void* gemm, Stream stream);

}  // namespace gradkit::backend
