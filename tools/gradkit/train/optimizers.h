// gradkit's owning optimizers behind train's Optimizer interface.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <type_traits>

#include "gradkit/optim/adam.h"
#include "gradkit/optim/lamb.h"
#include "gradkit/optim/mixed_precision.h"
#include "gradkit/optim/offloaded.h"
#include "gradkit/optim/sharded.h"
#include "train/backend.h"

namespace gradkit::train {

template <class T>
class OptimizerOf final : public Optimizer {
 public:
  template <class... Args>
  explicit OptimizerOf(Args&&... args) : optimizer_(std::forward<Args>(args)...) {}
  void step() override {
    if constexpr (std::is_same_v<T, OffloadedAdam> || std::is_same_v<T, OffloadedLamb>) {
      optimizer_.finish();  // every bucket at once: no hooks here
    } else {
      optimizer_.step();
    }
  }
  void mark_ready(size_t tensor) override {
    if constexpr (std::is_same_v<T, ShardedAdam> || std::is_same_v<T, ShardedLamb>) optimizer_.mark_ready(tensor);
  }
  void set_lr(float lr) override {
    if constexpr (std::is_same_v<T, Adam> || std::is_same_v<T, ShardedAdam> || std::is_same_v<T, OffloadedAdam>) {
      optimizer_.set_lr(0, lr);
    }
    else if constexpr (std::is_same_v<T, Lamb> || std::is_same_v<T, ShardedLamb> || std::is_same_v<T, OffloadedLamb>) {
      optimizer_.set_eta(lr);
    }
    else if constexpr (std::is_same_v<T, MixedPrecisionAdam>) optimizer_.optimizer().set_lr(0, lr);
    else optimizer_.optimizer().set_eta(lr);
  }
  void save_to(StateFile& file) override { optimizer_.save_to(file); }
  void check_state(const std::string& path, const StateFile& file) const override { optimizer_.check_state(path, file); }
  void apply_state(const StateFile& file) override { optimizer_.apply_state(file); }
  std::string note() const override {
    if constexpr (std::is_same_v<T, MixedPrecisionAdam> || std::is_same_v<T, MixedPrecisionLamb>) {
      if (optimizer_.scaler().options().mode == LossScaling::none) return "";  // bf16 weights: no loss scale
      return "loss scale " + std::to_string(static_cast<int64_t>(optimizer_.loss_scale()));
    } else if constexpr (std::is_same_v<T, OffloadedAdam> || std::is_same_v<T, OffloadedLamb>) {
      return "loss scale " + std::to_string(static_cast<int64_t>(optimizer_.scaler()->state().scale)) + ", offloaded";
    } else if constexpr (std::is_same_v<T, ShardedAdam> || std::is_same_v<T, ShardedLamb>) {
      return optimizer_.masters().empty() ? "" : "loss scale " + std::to_string(static_cast<int64_t>(optimizer_.loss_scale()));
    } else {
      return "";
    }
  }
  T& get() { return optimizer_; }

 private:
  T optimizer_;
};

// The moments' storage dtype --moments names.
inline DType moment_dtype(const TrainOptions& o) {
  return o.moments == "int8" || o.moments == "int4" ? DType::u8 : o.moments == "bf16" ? DType::bf16 : DType::f32;
}

// The moments' bits --moments names (int4: u8 moments of 4 bits).
inline int32_t moment_bits(const TrainOptions& o) { return o.moments == "int4" ? 4 : 8; }

// Adam's and LAMB's options for --moments (and LAMB's eta, --lr).
inline AdamOptions adam_options(const TrainOptions& o) {
  return AdamOptions{.moment_dtype = moment_dtype(o), .moment_bits = moment_bits(o)};
}
inline LambOptions lamb_options(const TrainOptions& o) {
  return LambOptions{.eta = o.lr, .moment_dtype = moment_dtype(o), .moment_bits = moment_bits(o)};
}

// One group over every parameter, with the run's hyperparameters.
template <class Group>
Group one_group(const TrainOptions& o, std::span<const TensorView> params, std::span<const TensorView> grads) {
  Group group;
  group.params.assign(params.begin(), params.end());
  group.grads.assign(grads.begin(), grads.end());
  if constexpr (std::is_same_v<Group, AdamGroup>) {
    group.hyperparameters.lr = o.lr;
    group.hyperparameters.weight_decay = o.weight_decay;
  } else {
    group.hyperparameters.lambda = o.weight_decay;
  }
  return group;
}

// The sharded Adam or LAMB over the context's communicator, with `scaler`;
// `loss_scale` receives the scale on the device (the CUDA model scales its
// loss by it).
inline std::unique_ptr<Optimizer> make_sharded_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                                         std::span<const TensorView> grads, const ShardContext& shard,
                                                         LossScalerOptions scaler,
                                                         const float** loss_scale = nullptr) {
  ShardedOptions options;
  options.scaler = scaler;
  options.adam = adam_options(o);
  options.lamb = lamb_options(o);
  options.master = o.master == "remainder" ? MasterStorage::remainder : MasterStorage::f32;  // for f16/bf16 weights
  auto make = [&]<class S, class Group>() {
    auto opt = std::make_unique<OptimizerOf<S>>(shard.comm, shard.layout,
                                                std::vector<Group>{one_group<Group>(o, params, grads)}, options);
    if (loss_scale != nullptr) *loss_scale = opt->get().loss_scale_device();
    return std::unique_ptr<Optimizer>(std::move(opt));
  };
  if (o.optimizer == "adam") return make.template operator()<ShardedAdam, AdamGroup>();
  return make.template operator()<ShardedLamb, LambGroup>();
}

// MixedPrecision<Adam or Lamb> over the model's f16/bf16 weights with
// `options` (--master picks how the masters are kept); `loss_scale`
// receives the scale on the device.
inline std::unique_ptr<Optimizer> make_mixed_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                                       std::span<const TensorView> grads, MixedPrecisionOptions options,
                                                       const float** loss_scale = nullptr) {
  options.master = o.master == "remainder" ? MasterStorage::remainder : MasterStorage::f32;
  auto finish = [&](auto opt) {
    if (loss_scale != nullptr) *loss_scale = opt->get().loss_scale_device();
    return std::unique_ptr<Optimizer>(std::move(opt));
  };
  if (o.optimizer == "adam") {
    return finish(std::make_unique<OptimizerOf<MixedPrecisionAdam>>(
        std::vector<AdamGroup>{one_group<AdamGroup>(o, params, grads)}, options, adam_options(o)));
  }
  return finish(std::make_unique<OptimizerOf<MixedPrecisionLamb>>(
      std::vector<LambGroup>{one_group<LambGroup>(o, params, grads)}, options,
      lamb_options(o)));
}

// Muon's composite (train/muon_adam.h); defined in muon_adam.cc.
std::unique_ptr<Optimizer> make_muon_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                               std::span<const TensorView> grads);

inline std::unique_ptr<Optimizer> make_plain_optimizer(const TrainOptions& o, std::span<const TensorView> params,
                                                       std::span<const TensorView> grads, const ShardContext* shard) {
  if (shard != nullptr) return make_sharded_optimizer(o, params, grads, *shard, {.mode = LossScaling::none});
  if (o.optimizer == "muon") return make_muon_optimizer(o, params, grads);
  if (o.optimizer == "adam") {
    return std::make_unique<OptimizerOf<Adam>>(std::vector<AdamGroup>{one_group<AdamGroup>(o, params, grads)},
                                               adam_options(o));
  }
  return std::make_unique<OptimizerOf<Lamb>>(std::vector<LambGroup>{one_group<LambGroup>(o, params, grads)},
                                             lamb_options(o));
}

}  // namespace gradkit::train
