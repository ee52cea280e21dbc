// The CPU twin of the CUDA multi-tensor driver: the same chunk table, walked
// by the threads of an OpenMP team (one chunk at a time each), so that the
// work splits the same way on every backend.
#pragma once

#include <cstdint>

#include "gradkit/core/multi_tensor_plan.h"

namespace gradkit::cpu {

struct ChunkView {
  const MultiTensorPlan* plan;
  PlanChunk chunk;
  int64_t index;  // the chunk's position in the plan's chunk table

  template <class T>
  T* tensor(int list) const {
    return static_cast<T*>(plan->pointers()[list * plan->num_tensors() + chunk.tensor]) + chunk.begin;
  }
  // The chunk's part of a list of per-block values (PlanList::block).
  template <class T>
  T* block_tensor(int list, int32_t block) const {
    return static_cast<T*>(plan->pointers()[list * plan->num_tensors() + chunk.tensor]) + chunk.begin / block;
  }
};

// Calls op(ChunkView) for every chunk of the plan.
template <class Op>
void for_each_chunk(const MultiTensorPlan& plan, const Op& op) {
  if (plan.empty()) return;
  const auto chunks = plan.chunks();
  const auto count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) op(ChunkView{&plan, chunks[c], c});
}

}  // namespace gradkit::cpu
