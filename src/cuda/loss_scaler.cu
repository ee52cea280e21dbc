#include "spec/loss_scaler.h"
#include "cuda/check.h"

namespace gradkit::spec {
namespace {

__global__ void update_kernel(LossScalerState* state, const bool* found_inf, LossScalerOptions options) {
  update_loss_scale(*state, *found_inf, options);
}

}  // namespace

void update_loss_scale_cuda(LossScalerState* state, const bool* found_inf, const LossScalerOptions& options,
                            Device device, Stream stream) {
  cuda::DeviceGuard guard(device.index);
  update_kernel<<<1, 1, 0, cuda::native(stream)>>>(state, found_inf, options);
  GRADKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace gradkit::spec
