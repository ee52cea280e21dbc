// The gradient check on the CPU: the same partials per chunk as the CUDA
// backend, combined in chunk order.
#include <cmath>
#include <type_traits>
#include <vector>

#include "backend/grad_check.h"
#include "backend/grad_check_math.h"
#include "backend/lamb_math.h"  // finite()
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::backend {

void grad_check_cpu(const MultiTensorPlan& plan, const GradCheckLaunch& l) {
  const NormType type = l.options.norm;
  const float scale = l.loss_scale_device != nullptr ? *l.loss_scale_device : l.loss_scale;
  const double inv_scale = 1.0 / static_cast<double>(scale);
  const float inv_scale_f = 1.0f / scale;
  if (!plan.empty()) {
    dispatch_dtype(plan.dtype(0), [&]<class G>() {
      if constexpr (!std::is_same_v<G, double>) {
        cpu::for_each_chunk(plan, [&](const cpu::ChunkView& chunk) {
          G* g = chunk.tensor<G>(0);
          double partial = 0;
          bool nonfinite = false;
          for (int i = 0; i < chunk.chunk.length; ++i) {
            const float raw = cpu::to_compute<float>(g[i]);
            nonfinite |= !finite(raw);
            partial = norm_accumulate(partial, static_cast<double>(raw) * inv_scale, type);
            if (l.options.write_unscaled) g[i] = cpu::from_compute<G>(raw * inv_scale_f);
          }
          l.partial_norms[chunk.index] = partial;
          l.partial_flags[chunk.index] = nonfinite;
        });
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

}  // namespace gradkit::backend
