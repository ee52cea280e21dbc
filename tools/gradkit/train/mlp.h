// A multilayer perceptron (ReLU between layers, softmax cross-entropy at
// the end), forward and backward on the CPU with OpenBLAS. Its parameters
// and gradients are gradkit tensor views: everything after backward
// (accumulation, all-reduce, the optimizer) is gradkit's.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "gradkit/core/tensor.h"

namespace gradkit::train {

class Mlp {
 public:
  // Layer widths, input first: {784, 256, 128, 10}.
  explicit Mlp(std::vector<int> widths);

  const std::vector<int>& widths() const { return widths_; }
  // Element counts of the parameters, in order: W1 (out x in), b1, W2, b2, ...
  std::vector<int64_t> parameter_sizes() const;

  // He-uniform weights and zero biases from `seed` (the same on every rank).
  void initialize(std::span<const TensorView> params, uint64_t seed) const;

  // Forward and backward on a batch (row-major images, one label each):
  // writes d(loss_scale * mean loss)/d(param) into `grads` (overwriting) and
  // returns the summed (unscaled) loss over the batch.
  double forward_backward(const float* images, const uint8_t* labels, int batch, float loss_scale,
                          std::span<const TensorView> params, std::span<const TensorView> grads);

  // The number of images in the batch whose largest logit is the label's.
  int64_t count_correct(const float* images, const uint8_t* labels, int batch, std::span<const TensorView> params);

 private:
  // Activations of each layer for the last batch (layer 0: the input).
  void forward(const float* images, int batch, std::span<const TensorView> params);

  std::vector<int> widths_;
  std::vector<std::vector<float>> activations_;  // layers 1..L, batch x width
  std::vector<float> delta_, delta_next_;
  const float* input_ = nullptr;
};

}  // namespace gradkit::train
