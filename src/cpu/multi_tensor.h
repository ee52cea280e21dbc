// The CPU twin of the CUDA multi-tensor driver: the same chunk table, walked
// by the threads of an OpenMP team, so that the work (and every per-chunk
// partial) splits the same way on every backend.
#pragma once

#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

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

// Calls op(ChunkView) for every chunk of the plan. The threads split the
// chunks by their elements (so by bytes: every list of a launch has one
// dtype), each taking a contiguous run of chunks: a chunk goes to the thread
// whose share of the elements holds its middle. Chunks differ in length
// (a tensor's last one, small tensors), so an equal count of chunks per
// thread would not be an equal amount of work.
template <class Op>
void for_each_chunk(const MultiTensorPlan& plan, const Op& op) {
  if (plan.empty()) return;
  const auto chunks = plan.chunks();
  const auto count = static_cast<int64_t>(chunks.size());
  const int64_t total = plan.total_elements();
#pragma omp parallel if (count > 1)
  {
    int64_t thread = 0, threads = 1;
#if defined(_OPENMP)
    thread = omp_get_thread_num();
    threads = omp_get_num_threads();
#endif
    // Twice the elements before each chunk's middle, against twice the
    // share boundaries, to stay in integers.
    const int64_t from = 2 * total * thread / threads, to = 2 * total * (thread + 1) / threads;
    int64_t before = 0;
    for (int64_t c = 0; c < count; ++c) {
      const int64_t middle = 2 * before + chunks[c].length;
      before += chunks[c].length;
      if (middle < from) continue;
      if (middle >= to) break;
      op(ChunkView{&plan, chunks[c], c});
    }
  }
}

}  // namespace gradkit::cpu
