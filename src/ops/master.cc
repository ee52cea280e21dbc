// Whole-tensor conversions between f32 masters and (bf16 weight, remainder)
// pairs, with the element formulas the kernels use (spec/master_math.h).
#include "gradkit/ops/master.h"

#include <string>
#include <vector>

#include "spec/master_math.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "ops/host_staging.h"

namespace gradkit {
namespace {

// The three tensors of a conversion, before anything is written: each its
// dtype, `numel` elements (the input's), on the input's `device`.
void check_master_tensors(std::string_view op, const TensorView& masters, const TensorView& weights,
                          const TensorView& remainder, int64_t numel, Device device) {
  ops::check_staged(op, "masters", masters, DType::f32, numel, device);
  ops::check_staged(op, "weights", weights, DType::bf16, numel, device);
  ops::check_staged(op, "remainder", remainder, DType::i16, numel, device);
}

}  // namespace

void split_masters(const TensorView& masters, const TensorView& weights, const TensorView& remainder) {
  check_master_tensors("split_masters", masters, weights, remainder, masters.numel, masters.device);
  const std::vector<float> m = ops::to_host<float>(masters);
  std::vector<uint16_t> w(m.size());
  std::vector<int16_t> r(m.size());
  for (size_t i = 0; i < m.size(); ++i) spec::split_master(m[i], w[i], r[i]);
  copy_from_host(weights.data, weights.device, w.data(), w.size() * sizeof(uint16_t));
  copy_from_host(remainder.data, remainder.device, r.data(), r.size() * sizeof(int16_t));
}

void join_masters(const TensorView& weights, const TensorView& remainder, const TensorView& masters) {
  check_master_tensors("join_masters", masters, weights, remainder, weights.numel, weights.device);
  const std::vector<uint16_t> w = ops::to_host<uint16_t>(weights);
  const std::vector<int16_t> r = ops::to_host<int16_t>(remainder);
  std::vector<float> m(w.size());
  for (size_t i = 0; i < m.size(); ++i) m[i] = spec::join_master(w[i], r[i]);
  copy_from_host(masters.data, masters.device, m.data(), m.size() * sizeof(float));
}

}  // namespace gradkit
