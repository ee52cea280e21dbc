// The CPU backend: f32 model (OpenBLAS), Adam or LAMB.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "train/backend.h"
#include "train/mlp.h"
#include "train/optimizers.h"

namespace gradkit::train {
namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const TrainOptions& o, const FashionMnist& data)
      : data_(data), model_(o.widths), images_(static_cast<size_t>(o.batch) * 784), labels_(o.batch) {}

  Device device() const override { return Device::cpu(); }
  DType parameter_dtype() const override { return DType::f32; }
  DType micro_gradient_dtype() const override { return DType::f32; }
  void initialize(std::span<const TensorView> params, uint64_t seed) override { model_.initialize(params, seed); }
  void start_epoch(const std::vector<int64_t>& order) override { order_ = order; }

  void forward_backward(int64_t offset, int batch, float scale, std::span<const TensorView> params,
                        std::span<const TensorView> grads) override {
    images_.resize(static_cast<size_t>(batch) * 784);
    labels_.resize(batch);
    for (int b = 0; b < batch; ++b) {
      const int64_t index = order_[offset + b];
      std::copy_n(data_.train.images.data() + index * 784, 784, images_.data() + static_cast<size_t>(b) * 784);
      labels_[b] = data_.train.labels[index];
    }
    loss_sum_ += model_.forward_backward(images_.data(), labels_.data(), batch, scale, params, grads);
  }

  double take_loss_sum() override { return std::exchange(loss_sum_, 0.0); }

  int64_t count_correct(int64_t first, int64_t step, std::span<const TensorView> params) override {
    std::vector<float> images;
    std::vector<uint8_t> labels;
    for (int64_t i = first; i < data_.test.count; i += step) {
      images.insert(images.end(), data_.test.images.begin() + i * 784, data_.test.images.begin() + (i + 1) * 784);
      labels.push_back(data_.test.labels[i]);
    }
    int64_t correct = 0;
    for (size_t at = 0; at < labels.size(); at += 1000) {
      const int n = static_cast<int>(std::min<size_t>(1000, labels.size() - at));
      correct += model_.count_correct(images.data() + at * 784, labels.data() + at, n, params);
    }
    return correct;
  }

  std::unique_ptr<Optimizer> make_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                            std::span<const TensorView> grads, const ShardContext* shard) override {
    return make_plain_optimizer(o, params, grads, shard);
  }

 private:
  const FashionMnist& data_;
  Mlp model_;
  std::vector<int64_t> order_;
  std::vector<float> images_;
  std::vector<uint8_t> labels_;
  double loss_sum_ = 0;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_backend(const TrainOptions& options, const FashionMnist& data) {
  return std::make_unique<CpuBackend>(options, data);
}

}  // namespace gradkit::train
