// A scattered list cut in two for the NCCL all-reduce. Tensors of at least
// `direct_bytes` are reduced where they lie, one ncclAllReduce each, all in
// one NCCL group (one launch); the smaller ones are packed into the fusion
// buffer and reduced by one more collective in the same group. On 2x H200 the
// BERT-large list takes about the time of one flat buffer this way, and a
// third longer all packed (measured: bench/log/2026-11-22.md, "large tensors
// reduced where they lie"): packing moves every byte four more times
// through memory, while NCCL runs grouped collectives of a few MiB each at
// the flat buffer's bandwidth. Tiny tensors are still packed because each
// grouped collective has a fixed cost of a few microseconds.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/core/tensor.h"

namespace gradkit::comm {

class SplitPlan {
 public:
  struct Direct {
    const void* input;
    void* output;
    int64_t count;
  };

  // `inputs` and `outputs` are the validated lists of one all-reduce (the
  // same list when in place). `source` / `destination`, when not null, is
  // the contiguous input / output the collective uses instead of the list's
  // own views. Tensors of at least `direct_bytes` go direct.
  SplitPlan(std::span<const TensorView> inputs, std::span<const TensorView> outputs, const unsigned char* source,
            unsigned char* destination, DType dtype, size_t direct_bytes);

  // Whether `t` is reduced where it lies under `direct_bytes` (never when
  // direct_bytes is 0).
  static bool goes_direct(const TensorView& t, size_t direct_bytes) {
    return direct_bytes > 0 && t.bytes() >= direct_bytes;
  }

  std::span<const Direct> direct() const { return direct_; }
  // The packed tensors, in list order: packed back to back at the start of
  // the fusion buffer, reduced there, unpacked.
  std::span<const TensorView> packed_inputs() const { return packed_inputs_; }
  std::span<const TensorView> packed_outputs() const { return packed_outputs_; }
  int64_t packed_total() const { return packed_total_; }
  // A plan over every output tensor, direct or packed, so that the
  // average's division covers them in one launch; made on first use (a
  // list only ever summed needs none).
  const MultiTensorPlan& divide_plan() const;

 private:
  std::vector<Direct> direct_;
  std::vector<TensorView> packed_inputs_, packed_outputs_;
  int64_t packed_total_ = 0;
  std::vector<TensorView> outputs_;  // the non-empty outputs, where the collective writes them
  mutable std::once_flag divide_plan_made_;
  mutable MultiTensorPlan divide_plan_;
};

}  // namespace gradkit::comm
