// CPU loops for zero and accumulate over a plan's chunks. Accumulate's loop
// has the dtype pair and the overwrite choice as template parameters and
// runs in the copy for the active instruction set (isa.h).
#include <cstring>

#include "spec/dtype_pairs.h"
#include "spec/gradient.h"
#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::spec {
namespace {

// No restrict: the values may be the buffers themselves (the plan allows
// the identical tensor in place); GCC checks the overlap at run time.
template <class B, class V, bool Overwrite>
struct AccumulateSpan {
  using C = cpu::compute_t<B>;
  static void run(int64_t n, B* buffer, const V* value) {
    for (int64_t i = 0; i < n; ++i) {
      const C x = cpu::to_compute<C>(value[i]);
      if constexpr (Overwrite) buffer[i] = cpu::from_compute<B>(x);
      else buffer[i] = cpu::from_compute<B>(cpu::to_compute<C>(buffer[i]) + x);
    }
  }
};

}  // namespace

void zero_cpu(const MultiTensorPlan& plan) {
  // +0 is all-zero bits in every supported format; memset is at the
  // bandwidth already (the C library picks its vector stores).
  const size_t element_bytes = dtype_size(plan.dtype(0));
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& c) {
    auto* base = static_cast<unsigned char*>(c.plan->pointers()[c.chunk.tensor]);
    std::memset(base + element_bytes * static_cast<size_t>(c.chunk.begin), 0,
                element_bytes * static_cast<size_t>(c.chunk.length));
  });
}

void accumulate_cpu(const MultiTensorPlan& plan, const AccumulateArgs& args) {
  const cpu::Isa isa = cpu::active_isa();  // before anything is written: it may throw
  if (args.do_update != nullptr && !*args.do_update) return;
  const bool overwrite = args.overwrite != nullptr ? *args.overwrite : args.overwrite_value;
  dispatch_dtype_pair({plan.dtype(0), plan.dtype(1)}, [&]<class B, class V>() {
    if constexpr (is_accumulate_pair_v<B, V>) {
      cpu::for_each_chunk(plan, [&](const cpu::ChunkView& c) {
        const int64_t n = c.chunk.length;
        if (overwrite) cpu::run_kernel<AccumulateSpan<B, V, true>>(isa, n, c.tensor<B>(0), static_cast<const V*>(c.tensor<V>(1)));
        else cpu::run_kernel<AccumulateSpan<B, V, false>>(isa, n, c.tensor<B>(0), static_cast<const V*>(c.tensor<V>(1)));
      });
    }
  });
}

}  // namespace gradkit::spec
