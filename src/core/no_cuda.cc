// The CUDA runtime interface in a build without CUDA: no devices, and every
// request for one is a clear error rather than a silent CPU fallback.
#include <string>

#include "spec/adam.h"
#include "spec/cuda_runtime.h"
#include "spec/grad_check.h"
#include "spec/gradient.h"
#include "spec/lamb.h"
#include "spec/loss_scaler.h"
#include "spec/muon.h"
#include "spec/step_counter.h"
#include "core/pinned.h"
#include "gradkit/core/error.h"

namespace gradkit::spec {

int cuda_device_count() { return 0; }

void check_memory_location(std::string_view op, std::string_view arg, size_t index,
                           const TensorView& view) {
  if (view.device.is_cuda()) {
    throw_argument_error(ErrorCode::backend_unavailable, op,
                         std::string(arg) + "[" + std::to_string(index) + "]",
                         "is on " + to_string(view.device) + ", but gradkit was built without CUDA");
  }
}

std::shared_ptr<void> upload(Device device, const void*, size_t) {
  throw Error(ErrorCode::backend_unavailable,
              "cannot use " + to_string(device) + ": gradkit was built without CUDA");
}

std::shared_ptr<void> allocate(Device device, size_t) { return upload(device, nullptr, 0); }
void copy_to_host(void*, const void*, size_t, Device device) { upload(device, nullptr, 0); }
void copy_from_host(void*, const void*, size_t, Device device) { upload(device, nullptr, 0); }
void copy_from_host_async(void*, const void*, size_t, Device device, Stream) { upload(device, nullptr, 0); }
void synchronize(Device device) { upload(device, nullptr, 0); }

void require_cuda_device(std::string_view op, int index) {
  throw Error(ErrorCode::backend_unavailable, std::string(op) + ": cannot use cuda:" +
                                                  std::to_string(index) +
                                                  ": gradkit was built without CUDA");
}

// The kernels: never reached, since planning CUDA tensors already fails
// above, but defined so that a build without CUDA links.
void zero_cuda(const MultiTensorPlan&, Stream) { upload(Device::cuda(0), nullptr, 0); }
void accumulate_cuda(const MultiTensorPlan&, const AccumulateArgs&, Stream) { upload(Device::cuda(0), nullptr, 0); }
void set_device_flag_cuda(Device device, bool*, Stream) { upload(device, nullptr, 0); }
void adam_cuda(const MultiTensorPlan&, const AdamLaunch&, Stream) { upload(Device::cuda(0), nullptr, 0); }
void increment_counter_cuda(Device device, int64_t*, const bool*, Stream) { upload(device, nullptr, 0); }
void grad_check_cuda(const MultiTensorPlan&, const GradCheckLaunch&, Stream) { upload(Device::cuda(0), nullptr, 0); }
void grad_check_combine_cuda(Device device, const double*, int, const GradCheckLaunch&, Stream) {
  upload(device, nullptr, 0);
}
void update_loss_scale_cuda(LossScalerState*, const bool*, const LossScalerOptions&, Device device, Stream) {
  upload(device, nullptr, 0);
}
void lamb_cuda(const MultiTensorPlan&, const LambLaunch&, Stream) { upload(Device::cuda(0), nullptr, 0); }
size_t muon_cuda_workspace_bytes(const MuonPlan::Batch&) {
  upload(Device::cuda(0), nullptr, 0);
  return 0;
}
size_t muon_cuda_workspace_bytes(int64_t, int64_t, int64_t, size_t) {
  upload(Device::cuda(0), nullptr, 0);
  return 0;
}
std::shared_ptr<void> muon_cuda_gemm(Device device, int, bool, int, int) { return upload(device, nullptr, 0); }
void muon_cuda_beside(const void*, std::span<const MuonLaunch>, bool, bool, Stream, size_t, size_t) {
  upload(Device::cuda(0), nullptr, 0);
}
void muon_cuda_join(const void*, Stream, size_t) { upload(Device::cuda(0), nullptr, 0); }
void muon_cuda_step(const void*, std::span<const MuonLaunch>, bool, bool, Stream, size_t) { upload(Device::cuda(0), nullptr, 0); }
void muon_cuda_prepare(const void*, std::span<const MuonLaunch>) { upload(Device::cuda(0), nullptr, 0); }

}  // namespace gradkit::spec

namespace gradkit::detail {

std::shared_ptr<void> allocate_registered(size_t bytes, bool) {
  throw Error(ErrorCode::backend_unavailable, "Buffer::pinned: cannot allocate " + std::to_string(bytes) +
                                                  " bytes of pinned host memory: gradkit was built without CUDA");
}

}  // namespace gradkit::detail
