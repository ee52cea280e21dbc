// The NCCL communicator's copies between a tensor list and its fusion buffer:
// the list is planned once (a MultiTensorPlan over the tensors and their
// places in the fusion buffer, its chunk table on the device), and each copy
// is one launch of the multi-tensor driver, whatever the number of tensors.
// The communicator keeps the plans in a LayoutCache (comm/layout_cache.h),
// so that the same gradients step after step cost one lookup and one launch
// each way.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "gradkit/core/multi_tensor_plan.h"
#include "gradkit/core/tensor.h"

namespace gradkit::comm {

class FusionCopyPlan {
 public:
  // Tensor i of `tensors` (all of `dtype`) lies in the fusion buffer at
  // element offset numel(0) + ... + numel(i - 1) from `fusion`.
  FusionCopyPlan(std::span<const TensorView> tensors, unsigned char* fusion, DType dtype);

  // Copies the elements [begin, end) of the list's concatenation from the
  // tensors to the fusion buffer (to_fusion) or back, on `stream`: one kernel
  // launch over the chunks that meet the range.
  void copy(int64_t begin, int64_t end, bool to_fusion, cudaStream_t stream) const;

  int64_t total() const { return plan_.empty() ? 0 : plan_.total_elements(); }

 private:
  MultiTensorPlan plan_;
  unsigned char* fusion_;
  DType dtype_;
  std::vector<int64_t> chunk_begin_;  // each chunk's first element in the concatenation (ascending)
};

}  // namespace gradkit::comm
