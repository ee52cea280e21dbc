// Gradient control: zero, accumulate, accumulate-v2 (ONNX Runtime's
// ZeroGradient, InPlaceAccumulator, InPlaceAccumulatorV2). docs/ops.md states
// exactly what each computes.
//
// Every function validates all of its arguments before anything is written
// and throws gradkit::Error naming the offending argument. CUDA calls are
// enqueued on `stream` and return without synchronizing; CPU calls complete
// before they return.
#pragma once

#include <span>

#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/core/tensor.h"

namespace gradkit {

// The (buffer, value) dtype pairs accumulate and accumulate_v2 take: every
// pair of {f32, f16, bf16}, and (f64, f64). Tests iterate over this table.
std::span<const DTypePair> accumulate_dtype_pairs();
bool is_accumulate_pair(DTypePair pair);

// buffer = +0, every element. Any dtype.
void zero(std::span<const TensorView> buffers, Stream stream = {});
void zero(const TensorView& buffer, Stream stream = {});

// buffer += value (computed in f32, or f64 for f64, rounded once to the
// buffer's dtype). If do_update is given and false, nothing is written.
void accumulate(std::span<const TensorView> buffers, std::span<const TensorView> values,
                Flag do_update = Flag::none(), Stream stream = {});
void accumulate(const TensorView& buffer, const TensorView& value,
                Flag do_update = Flag::none(), Stream stream = {});

// If overwrite is true: buffer = value (cast to the buffer's dtype);
// otherwise buffer += value. Then `updated` (if given) is set to true.
void accumulate_v2(std::span<const TensorView> buffers, std::span<const TensorView> values,
                   Flag overwrite = Flag::none(), Flag updated = Flag::none(), Stream stream = {});
void accumulate_v2(const TensorView& buffer, const TensorView& value,
                   Flag overwrite = Flag::none(), Flag updated = Flag::none(), Stream stream = {});

// The same operations on lists planned once. Making the plan validates the
// lists and (for CUDA) uploads their tables; each call afterwards costs the
// same host time whatever the number of tensors, and can be captured in a
// CUDA graph when its flags are device flags or absent.
class ZeroPlan {
 public:
  explicit ZeroPlan(std::span<const TensorView> buffers);
  void run(Stream stream = {}) const;
  const MultiTensorPlan& plan() const { return plan_; }

 private:
  MultiTensorPlan plan_;
};

class AccumulatePlan {
 public:
  AccumulatePlan(std::span<const TensorView> buffers, std::span<const TensorView> values);
  void accumulate(Flag do_update = Flag::none(), Stream stream = {}) const;
  void accumulate_v2(Flag overwrite = Flag::none(), Flag updated = Flag::none(),
                     Stream stream = {}) const;
  const MultiTensorPlan& plan() const { return plan_; }

 private:
  MultiTensorPlan plan_;
};

}  // namespace gradkit
