// The CUDA backend: f16 model (cuBLAS), f32 master weights and dynamic loss
// scaling through gradkit::MixedPrecision over Adam or LAMB, or with
// --offload gradkit::OffloadedAdam or OffloadedLamb (masters and moments on the host).
#include <vector>

#include "gradkit/core/half.h"
#include "gradkit/core/memory.h"
#include "train/backend.h"
#include "train/mlp.h"
#include "train/mlp_cuda.h"
#include "train/optimizers.h"

namespace gradkit::train {
namespace {

class CudaBackend final : public TrainBackend {
 public:
  CudaBackend(const TrainOptions& o, const FashionMnist& data, Device device)
      : device_(device), widths_(o.widths), model_(o.widths, device) {
    model_.upload(data.train, data.test);
  }

  Device device() const override { return device_; }
  DType parameter_dtype() const override { return DType::f16; }
  DType micro_gradient_dtype() const override { return DType::f16; }

  void initialize(std::span<const TensorView> params, uint64_t seed) override {
    // The CPU model's initial weights, rounded to f16: every backend starts alike.
    const Mlp host(widths_);
    std::vector<std::vector<float>> values;
    std::vector<TensorView> views;
    for (const TensorView& p : params) {
      values.emplace_back(p.numel);
      views.push_back(view(values.back().data(), p.numel));
    }
    host.initialize(views, seed);
    for (size_t i = 0; i < params.size(); ++i) {
      std::vector<half> h(values[i].size());
      for (size_t k = 0; k < h.size(); ++k) h[k] = half(values[i][k]);
      copy_from_host(params[i].data, device_, h.data(), h.size() * sizeof(half));
    }
  }

  void start_epoch(const std::vector<int64_t>& order) override { model_.set_order(order); }

  void forward_backward(int64_t offset, int batch, float scale, std::span<const TensorView> params,
                        std::span<const TensorView> grads) override {
    model_.forward_backward(offset, batch, scale, loss_scale_, params, grads);
  }

  double take_loss_sum() override { return model_.take_loss_sum(); }

  int64_t count_correct(int64_t first, int64_t step, std::span<const TensorView> params) override {
    return model_.count_correct(first, step, params);
  }

  // --offload: the optimizer's state on the host, its step on the CPU.
  template <class Offloaded>
  std::unique_ptr<Optimizer> make_offloaded(const TrainOptions& o, std::span<const TensorView> params,
                                            std::span<const TensorView> grads, const OffloadedOptions& options) {
    using Group = typename Offloaded::Group;
    auto opt = std::make_unique<OptimizerOf<Offloaded>>(std::vector<Group>{one_group<Group>(o, params, grads)}, options);
    loss_scale_ = opt->get().loss_scale_device();
    return opt;
  }

  std::unique_ptr<Optimizer> make_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                            std::span<const TensorView> grads, const ShardContext* shard) override {
    MixedPrecisionOptions mp;  // dynamic loss scaling with PyTorch's defaults
    if (shard != nullptr) return make_sharded_optimizer(o, params, grads, *shard, mp.scaler, &loss_scale_);
    if (o.offload) {
      OffloadedOptions options;
      options.scaler = mp.scaler;
      options.adam = adam_options(o);  // --moments: the host moments' storage
      options.lamb = lamb_options(o);
      if (o.optimizer == "lamb") return make_offloaded<OffloadedLamb>(o, params, grads, options);
      return make_offloaded<OffloadedAdam>(o, params, grads, options);
    }
    return make_mixed_optimizer(o, params, grads, mp, &loss_scale_);
  }

 private:
  Device device_;
  std::vector<int> widths_;
  MlpCuda model_;
  const float* loss_scale_ = nullptr;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_backend(const TrainOptions& options, const FashionMnist& data, Device device) {
  return std::make_unique<CudaBackend>(options, data, device);
}

}  // namespace gradkit::train
