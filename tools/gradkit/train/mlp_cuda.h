// The same MLP on a GPU, in f16 with f32 accumulation (cuBLAS GemmEx), for
// mixed-precision training: weights and gradients in f16, the loss scaled
// by a factor read from device memory (the loss scaler's), the training
// images kept on the device for the whole run.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gradkit/core/memory.h"
#include "gradkit/core/tensor.h"
#include "train/fashion_mnist.h"

namespace gradkit::train {

class MlpCuda {
 public:
  MlpCuda(std::vector<int> widths, Device device);
  ~MlpCuda();
  MlpCuda(const MlpCuda&) = delete;
  MlpCuda& operator=(const MlpCuda&) = delete;

  // Keeps the images (as f16) and labels on the device.
  void upload(const Split& train, const Split& test);
  // The training images' order for this epoch.
  void set_order(const std::vector<int64_t>& order);

  // Forward and backward on order[offset, offset + batch): writes the
  // gradients of (loss_scale * scale * mean loss) into `grads` (f16) and
  // adds the batch's summed loss to the device's running sum.
  void forward_backward(int64_t offset, int batch, float scale, const float* loss_scale,
                        std::span<const TensorView> params, std::span<const TensorView> grads);
  // Returns and clears the running loss sum (synchronizes).
  double take_loss_sum();
  // Test images first, first + step, ...: how many are classified right.
  int64_t count_correct(int64_t first, int64_t step, std::span<const TensorView> params);

 private:
  struct State;
  void reserve(int batch);  // scratch for batches of up to `batch` images
  void forward(const void* input, int batch, std::span<const TensorView> params);
  std::vector<int> widths_;
  Device device_;
  std::unique_ptr<State> state_;
};

}  // namespace gradkit::train
