#include "train/mlp.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "gradkit/core/error.h"

namespace gradkit::train {
namespace {

const float* data(const TensorView& t) { return static_cast<const float*>(t.data); }
float* mutable_data(const TensorView& t) { return static_cast<float*>(t.data); }

}  // namespace

Mlp::Mlp(std::vector<int> widths) : widths_(std::move(widths)) {
  if (widths_.size() < 2) {
    throw_argument_error(ErrorCode::invalid_argument, "Mlp", "widths", "has fewer than 2 layers");
  }
  for (int w : widths_) {
    if (w <= 0) throw_argument_error(ErrorCode::invalid_argument, "Mlp", "widths", "has a width <= 0");
  }
  activations_.resize(widths_.size());
}

std::vector<int64_t> Mlp::parameter_sizes() const {
  std::vector<int64_t> sizes;
  for (size_t l = 1; l < widths_.size(); ++l) {
    sizes.push_back(int64_t{widths_[l]} * widths_[l - 1]);
    sizes.push_back(widths_[l]);
  }
  return sizes;
}

void Mlp::initialize(std::span<const TensorView> params, uint64_t seed) const {
  std::mt19937_64 rng(seed);
  for (size_t l = 1; l < widths_.size(); ++l) {
    const float bound = std::sqrt(6.0f / static_cast<float>(widths_[l - 1]));
    std::uniform_real_distribution<float> uniform(-bound, bound);
    const TensorView& w = params[2 * (l - 1)];
    for (int64_t i = 0; i < w.numel; ++i) mutable_data(w)[i] = uniform(rng);
    std::fill_n(mutable_data(params[2 * (l - 1) + 1]), widths_[l], 0.0f);
  }
}

void Mlp::forward(const float* images, int batch, std::span<const TensorView> params) {
  input_ = images;
  const float* in = images;
  const size_t layers = widths_.size() - 1;
  for (size_t l = 1; l <= layers; ++l) {
    const int n_in = widths_[l - 1], n_out = widths_[l];
    std::vector<float>& out = activations_[l];
    out.resize(static_cast<size_t>(batch) * n_out);
    const float* bias = data(params[2 * (l - 1) + 1]);
    for (int b = 0; b < batch; ++b) std::copy_n(bias, n_out, out.data() + static_cast<size_t>(b) * n_out);
    // out (batch x n_out) += in (batch x n_in) * W^T (W: n_out x n_in)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, n_out, n_in, 1.0f, in, n_in,
                data(params[2 * (l - 1)]), n_in, 1.0f, out.data(), n_out);
    if (l < layers) {
      for (float& v : out) v = v > 0 ? v : 0;
    }
    in = out.data();
  }
}

double Mlp::forward_backward(const float* images, const uint8_t* labels, int batch, float loss_scale,
                             std::span<const TensorView> params, std::span<const TensorView> grads) {
  forward(images, batch, params);
  const size_t layers = widths_.size() - 1;
  const int classes = widths_.back();
  const std::vector<float>& logits = activations_[layers];
  // d(mean loss)/d(logits) = (softmax - one_hot) / batch, times the loss scale.
  delta_.resize(logits.size());
  double loss = 0;
  const float scale = loss_scale / static_cast<float>(batch);
  for (int b = 0; b < batch; ++b) {
    const float* z = logits.data() + static_cast<size_t>(b) * classes;
    const float top = *std::max_element(z, z + classes);
    double sum = 0;
    for (int c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(z[c] - top));
    loss += std::log(sum) - static_cast<double>(z[labels[b]] - top);
    for (int c = 0; c < classes; ++c) {
      const double p = std::exp(static_cast<double>(z[c] - top)) / sum;
      delta_[static_cast<size_t>(b) * classes + c] = static_cast<float>(p - (c == labels[b] ? 1.0 : 0.0)) * scale;
    }
  }
  for (size_t l = layers; l >= 1; --l) {
    const int n_in = widths_[l - 1], n_out = widths_[l];
    const float* in = l == 1 ? input_ : activations_[l - 1].data();
    // dW (n_out x n_in) = delta^T (n_out x batch) * in (batch x n_in)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_out, n_in, batch, 1.0f, delta_.data(), n_out, in, n_in,
                0.0f, mutable_data(grads[2 * (l - 1)]), n_in);
    float* db = mutable_data(grads[2 * (l - 1) + 1]);
    std::fill_n(db, n_out, 0.0f);
    for (int b = 0; b < batch; ++b) {
      for (int o = 0; o < n_out; ++o) db[o] += delta_[static_cast<size_t>(b) * n_out + o];
    }
    if (l == 1) break;
    // delta for the layer below: (delta * W) masked by the ReLU.
    delta_next_.resize(static_cast<size_t>(batch) * n_in);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, n_in, n_out, 1.0f, delta_.data(), n_out,
                data(params[2 * (l - 1)]), n_in, 0.0f, delta_next_.data(), n_in);
    const std::vector<float>& below = activations_[l - 1];
    for (size_t i = 0; i < delta_next_.size(); ++i) {
      if (below[i] <= 0) delta_next_[i] = 0;
    }
    delta_.swap(delta_next_);
  }
  return loss;
}

int64_t Mlp::count_correct(const float* images, const uint8_t* labels, int batch, std::span<const TensorView> params) {
  forward(images, batch, params);
  const int classes = widths_.back();
  const std::vector<float>& logits = activations_.back();
  int64_t correct = 0;
  for (int b = 0; b < batch; ++b) {
    const float* z = logits.data() + static_cast<size_t>(b) * classes;
    correct += (std::max_element(z, z + classes) - z) == labels[b];
  }
  return correct;
}

}  // namespace gradkit::train
