// The tensor lists the benchmarks run on: one big tensor, GPT-2 small's and
// BERT-large's lists, and many small tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gradkit::tool {

struct Workload {
  std::string name;
  std::vector<int64_t> sizes;  // element count of each tensor
  int64_t total() const;
};

// One tensor of `elements` elements.
Workload single_tensor(int64_t elements);
// BERT-large's 389 parameter tensors (334,092,288 elements): embeddings and
// their layer norm, then 24 layers of attention, feed-forward and layer norms.
Workload bert_large();
// GPT-2 small's 148 parameter tensors (124,439,808 elements): token and
// position embeddings, 12 layers of layer norm, attention and MLP, the
// final layer norm.
Workload gpt2_small();
// `count` tensors of 1K to 64K elements, log-uniform, from a fixed seed.
Workload small_tensors(int count, uint64_t seed = 2026);
// The same lists with every size divided by `divisor` (at least 1 element):
// the CPU runs the same shapes at a size it can finish.
Workload scaled(const Workload& w, int64_t divisor);

}  // namespace gradkit::tool
