// The gradient check on the CPU: a partial norm and flag per chunk (the
// CUDA backend's chunks), combined in chunk order.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "spec/grad_check.h"
#include "spec/grad_check_math.h"
#include "spec/lamb_math.h"  // finite()
#include "cpu/isa.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::spec {
namespace {

// One chunk's partial norm and non-finite flag, with the norm type and the
// write-back as template parameters. The element work runs as vector loops
// over blocks of kBlock; the L2 partial is then summed one element at a
// time, in element order (as the results promise:
// docs/cpu-kernels.md), so that sum is the loop's latency floor. The
// infinity norm's maximum does not depend on the order: it is taken as the
// largest magnitude's bit pattern (for doubles >= 0 the integer order is the
// numeric order), NaNs left out as norm_accumulate leaves them out.
template <class G, NormType Type, bool Write>
struct CheckSpan {
  static constexpr int kBlock = 512;
  static void run(int64_t n, G* __restrict g, double inv_scale, float inv_scale_f, double* partial_out,
                  bool* nonfinite_out) {
    double partial = 0;
    uint64_t top = 0;  // infinity: the largest magnitude's bits
    int bad = 0;
    alignas(64) double squares[kBlock];
    for (int64_t base = 0; base < n; base += kBlock) {
      const int count = static_cast<int>(n - base < kBlock ? n - base : kBlock);
      G* x = g + base;
      for (int k = 0; k < count; ++k) {
        const float raw = cpu::to_compute<float>(x[k]);
        bad |= !finite(raw);
        const double value = static_cast<double>(raw) * inv_scale;
        if constexpr (Type == NormType::l2) {
          squares[k] = value * value;
        } else {
          const uint64_t magnitude = float_bits64(value) & 0x7fffffffffffffffull;
          const uint64_t counted = magnitude > 0x7ff0000000000000ull ? 0 : magnitude;
          top = counted > top ? counted : top;
        }
        if constexpr (Write) x[k] = cpu::from_compute<G>(raw * inv_scale_f);
      }
      if constexpr (Type == NormType::l2) {
        for (int k = 0; k < count; ++k) partial = partial + squares[k];
      }
    }
    if constexpr (Type == NormType::infinity) partial = double_from_bits(top);
    *partial_out = partial;
    *nonfinite_out = bad != 0;
  }

  static uint64_t float_bits64(double x) {
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits;
  }
  static double double_from_bits(uint64_t bits) {
    double x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }
};

template <class G, NormType Type, bool Write>
void check_chunks(const MultiTensorPlan& plan, const GradCheckLaunch& l, cpu::Isa isa, double inv_scale,
                  float inv_scale_f) {
  cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
    bool nonfinite = false;
    cpu::run_kernel<CheckSpan<G, Type, Write>>(isa, int64_t{chunk.chunk.length}, chunk.tensor<G>(0), inv_scale,
                                               inv_scale_f, &l.partial_norms[chunk.index], &nonfinite);
    l.partial_flags[chunk.index] = nonfinite;
  });
}

}  // namespace

void grad_check_cpu(const MultiTensorPlan& plan, const GradCheckLaunch& l) {
  const cpu::Isa isa = cpu::active_isa();  // before anything is written: it may throw
  const NormType type = l.options.norm;
  const float scale = l.loss_scale_device != nullptr ? *l.loss_scale_device : l.loss_scale;
  const double inv_scale = 1.0 / static_cast<double>(scale);
  const float inv_scale_f = 1.0f / scale;
  if (!plan.empty()) {
    dispatch_dtype(plan.dtype(0), [&]<class G>() {
      if constexpr (!std::is_same_v<G, double>) {
        auto with_write = [&]<NormType Type>() {
          if (l.options.write_unscaled) check_chunks<G, Type, true>(plan, l, isa, inv_scale, inv_scale_f);
          else check_chunks<G, Type, false>(plan, l, isa, inv_scale, inv_scale_f);
        };
        if (type == NormType::infinity) with_write.template operator()<NormType::infinity>();
        else with_write.template operator()<NormType::l2>();
      }
    });
  }
  const auto chunks = plan.chunks();
  std::vector<double> per_tensor(plan.num_tensors(), 0.0);
  std::vector<bool> tensor_nonfinite(plan.num_tensors(), false);
  double global = 0;
  bool nonfinite = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    per_tensor[chunks[c].tensor] = norm_combine(per_tensor[chunks[c].tensor], l.partial_norms[c], type);
    if (l.partial_flags[c]) tensor_nonfinite[chunks[c].tensor] = true;
    global = norm_combine(global, l.partial_norms[c], type);
    nonfinite = nonfinite || l.partial_flags[c];
  }
  const GradientCheckOutputs& out = l.outputs;
  if (out.tensor_norms != nullptr) {
    for (size_t t = 0; t < per_tensor.size(); ++t) {
      out.tensor_norms[t] = tensor_nonfinite[t] ? NAN : static_cast<float>(norm_finish(per_tensor[t], type));
    }
  }
  write_check_outputs(out, global, nonfinite, type, scale, l.options.max_norm);
}

void grad_check_combine_cpu(const double* partials, int count, const GradCheckLaunch& l) {
  double partial = 0;
  bool nonfinite = false;
  combine_partials(partials, count, l.options.norm, &partial, &nonfinite);
  const float scale = l.loss_scale_device != nullptr ? *l.loss_scale_device : l.loss_scale;
  write_check_outputs(l.outputs, partial, nonfinite, l.options.norm, scale, l.options.max_norm);
}

}  // namespace gradkit::spec
