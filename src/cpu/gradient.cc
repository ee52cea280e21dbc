// CPU loops for zero and accumulate over a plan's chunks.
#include <cstring>

#include "backend/dtype_pairs.h"
#include "backend/gradient.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::backend {

void zero_cpu(const MultiTensorPlan& plan) {
  // +0 is all-zero bits in every supported format.
  const size_t element_bytes = dtype_size(plan.dtype(0));
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& c) {
    auto* base = static_cast<unsigned char*>(c.plan->pointers()[c.chunk.tensor]);
    std::memset(base + element_bytes * static_cast<size_t>(c.chunk.begin), 0,
                element_bytes * static_cast<size_t>(c.chunk.length));
  });
}

void accumulate_cpu(const MultiTensorPlan& plan, const AccumulateArgs& args) {
  if (args.do_update != nullptr && !*args.do_update) return;
  const bool overwrite = args.overwrite != nullptr ? *args.overwrite : args.overwrite_value;
  dispatch_dtype_pair({plan.dtype(0), plan.dtype(1)}, [&]<class B, class V>() {
    if constexpr (is_accumulate_pair_v<B, V>) {
      using C = cpu::compute_t<B>;
      cpu::for_each_chunk(plan, [&](const cpu::ChunkView& c) {
        B* buffer = c.tensor<B>(0);
        const V* value = c.tensor<V>(1);
        const int n = c.chunk.length;
        if (overwrite) {
          for (int i = 0; i < n; ++i) buffer[i] = cpu::from_compute<B>(cpu::to_compute<C>(value[i]));
        } else {
          for (int i = 0; i < n; ++i) {
            buffer[i] = cpu::from_compute<B>(cpu::to_compute<C>(buffer[i]) + cpu::to_compute<C>(value[i]));
          }
        }
      });
    }
  });
}

}  // namespace gradkit::backend
