// Where a training run computes: the model's forward and backward, its
// parameters' and gradients' dtypes, and the optimizer that suits them.
// The CPU backend trains in f32 with Adam or LAMB; the CUDA backend trains
// in f16 with f32 master weights and dynamic loss scaling
// (gradkit::MixedPrecision).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradkit/core/tensor.h"
#include "train/fashion_mnist.h"
#include "train/trainer.h"

namespace gradkit {
class Communicator;
class StateFile;
struct ShardedLayout;
}

namespace gradkit::train {

// The owning optimizers behind one interface.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  // Stage 2 of the sharded step: gradient `tensor` is final (a no-op for
  // the others, which reduce before step()).
  virtual void mark_ready(size_t /*tensor*/) {}
  virtual void set_lr(float lr) = 0;
  // Collective for the sharded optimizer (every rank calls it).
  virtual void save_to(StateFile& file) = 0;
  virtual void check_state(const std::string& path, const StateFile& file) const = 0;
  virtual void apply_state(const StateFile& file) = 0;
  // A note for the epoch's summary (the loss scale, for mixed precision).
  virtual std::string note() const { return ""; }
};

struct ShardContext {
  Communicator& comm;
  const ShardedLayout& layout;
};

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;
  virtual Device device() const = 0;
  virtual DType parameter_dtype() const = 0;
  virtual DType micro_gradient_dtype() const = 0;
  // He-uniform weights from `seed` (computed in f32 on the host, the same on
  // every rank and backend), written into `params`.
  virtual void initialize(std::span<const TensorView> params, uint64_t seed) = 0;
  virtual void start_epoch(const std::vector<int64_t>& order) = 0;
  // Forward and backward on order[offset, offset + batch): the gradient of
  // scale * mean loss into `grads`; the loss adds to a running sum.
  virtual void forward_backward(int64_t offset, int batch, float scale, std::span<const TensorView> params,
                                std::span<const TensorView> grads) = 0;
  virtual double take_loss_sum() = 0;
  virtual int64_t count_correct(int64_t first, int64_t step, std::span<const TensorView> params) = 0;
  // `shard`, when given, makes the sharded optimizer over its communicator
  // and layout (params and grads are views of arenas made from the layout).
  virtual std::unique_ptr<Optimizer> make_optimizer(const TrainOptions& options, std::span<const TensorView> params,
                                                    std::span<const TensorView> grads,
                                                    const struct ShardContext* shard) = 0;
};

std::unique_ptr<TrainBackend> make_cpu_backend(const TrainOptions& options, const FashionMnist& data);
// Throws Error(backend_unavailable) in a build without CUDA and NCCL.
std::unique_ptr<TrainBackend> make_cuda_backend(const TrainOptions& options, const FashionMnist& data, Device device);

}  // namespace gradkit::train
