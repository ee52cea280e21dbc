// The CPU backend: f32 model (OpenBLAS), Adam or LAMB; with --master
// remainder, bf16 weights (the model computes in f32 on an exact f32 copy of
// them) and MixedPrecision<Adam or Lamb> (or, with --shard, Sharded<Adam or
// Lamb>) keeping each master as weight + remainder.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "gradkit/ops/gradient.h"
#include "gradkit/comm/gradient_arena.h"
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
      : data_(data),
        model_(o.widths),
        bf16_(o.master == "remainder"),
        images_(static_cast<size_t>(o.batch) * 784),
        labels_(o.batch) {
    if (bf16_) f32_ = std::make_unique<GradientArena>(Device::cpu(), DType::f32, model_.parameter_sizes());
  }

  Device device() const override { return Device::cpu(); }
  DType parameter_dtype() const override { return bf16_ ? DType::bf16 : DType::f32; }
  DType micro_gradient_dtype() const override { return DType::f32; }
  void initialize(std::span<const TensorView> params, uint64_t seed) override {
    if (!bf16_) return model_.initialize(params, seed);
    // The f32 weights rounded to bf16: each master starts as its weight.
    model_.initialize(f32_->gradients(), seed);
    AccumulatePlan(params, f32_->gradients()).accumulate_v2(Flag::host(true));
  }
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
    loss_sum_ += model_.forward_backward(images_.data(), labels_.data(), batch, scale, f32_params(params), grads);
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
      correct += model_.count_correct(images.data() + at * 784, labels.data() + at, n, f32_params(params));
    }
    return correct;
  }

  std::unique_ptr<Optimizer> make_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                            std::span<const TensorView> grads, const ShardContext* shard) override {
    // Sharded: Sharded<Adam or Lamb> keeps the remainders of its shard.
    if (!bf16_ || shard != nullptr) return make_plain_optimizer(o, params, grads, shard);
    MixedPrecisionOptions mp;
    mp.scaler.mode = LossScaling::none;  // bf16 gradients need no loss scale (and the model's are f32)
    return make_mixed_optimizer(o, params, grads, mp);
  }

 private:
  // The weights the f32 model reads: `params`, or their exact f32 copy.
  std::span<const TensorView> f32_params(std::span<const TensorView> params) {
    if (!bf16_) return params;
    AccumulatePlan(f32_->gradients(), params).accumulate_v2(Flag::host(true));
    return f32_->gradients();
  }

  const FashionMnist& data_;
  Mlp model_;
  bool bf16_;                            // --master remainder: bf16 weights
  std::unique_ptr<GradientArena> f32_;   // their f32 copy
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
