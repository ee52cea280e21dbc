#include "ops/optimizer_dtypes.h"

#include <string>
#include <utility>

#include "gradkit/core/error.h"

namespace gradkit::ops {

void check_optimizer_dtypes(std::string_view op, const MultiTensorPlan& plan, const OptionalLists& lists) {
  if (plan.num_tensors() == 0) return;
  const DType w = plan.dtype(0), g = plan.dtype(1), m = plan.dtype(2), v = plan.dtype(3);
  auto fail = [op](std::string_view arg, DType got, const std::string& expected) {
    throw_argument_error(ErrorCode::dtype_unsupported, op, arg,
                         "has dtype " + std::string(dtype_name(got)) + ", expected " + expected);
  };
  if (lists.weight_remainder >= 0 && lists.update >= 0) {
    throw_argument_error(ErrorCode::invalid_argument, op, "update",
                         "is given with weight_remainder; expected none (the step writes the f32 master as the "
                         "weights and their remainders, which a returned update would leave alone)");
  }
  if (lists.update >= 0 && plan.dtype(lists.update) != w) {
    fail("update", plan.dtype(lists.update), std::string(dtype_name(w)) + " (the dtype of the weights)");
  }
  if (w == DType::f64) {
    if (lists.weight_remainder >= 0) fail("weights", w, "bf16 (the weights weight_remainder completes to an f32 master)");
    if (g != DType::f64) fail("grads", g, "f64 (the dtype of the weights)");
    if (m != DType::f64) fail("exp_avg", m, "f64 (the dtype of the weights)");
    if (v != DType::f64) fail("exp_avg_sq", v, "f64 (the dtype of the weights)");
    if (lists.max_exp_avg_sq >= 0 && plan.dtype(lists.max_exp_avg_sq) != DType::f64) {
      fail("max_exp_avg_sq", plan.dtype(lists.max_exp_avg_sq), "f64");
    }
    if (lists.model_copy >= 0) fail("model_copy", plan.dtype(lists.model_copy), "no model copy with f64 weights");
    return;
  }
  if (lists.weight_remainder >= 0) {
    if (w != DType::bf16) fail("weights", w, "bf16 (the weights weight_remainder completes to an f32 master)");
    if (plan.dtype(lists.weight_remainder) != DType::i16) {
      fail("weight_remainder", plan.dtype(lists.weight_remainder), "i16");
    }
    if (lists.model_copy >= 0) {
      throw_argument_error(ErrorCode::invalid_argument, op, "model_copy",
                           "is given with weight_remainder; expected none (the bf16 weights are the model's)");
    }
  } else if (w != DType::f32) {
    fail("weights", w, "f32 (master weights) or f64, or bf16 with weight_remainder");
  }
  if (g == DType::f64) fail("grads", g, "f32, f16 or bf16 with f32 weights");
  if (m != DType::f32 && m != DType::bf16 && !(lists.u8_moments && m == DType::u8)) {
    fail("exp_avg", m, lists.u8_moments ? "f32, bf16 or u8" : "f32 or bf16");
  }
  if (v != m) fail("exp_avg_sq", v, std::string(dtype_name(m)) + " (the dtype of exp_avg)");
  if (lists.max_exp_avg_sq >= 0 && plan.dtype(lists.max_exp_avg_sq) != m) {
    fail("max_exp_avg_sq", plan.dtype(lists.max_exp_avg_sq), std::string(dtype_name(m)));
  }
  if (lists.model_copy >= 0 && plan.dtype(lists.model_copy) != DType::f16 && plan.dtype(lists.model_copy) != DType::bf16) {
    fail("model_copy", plan.dtype(lists.model_copy), "f16 or bf16");
  }
}

void check_moment_bits(std::string_view op, int32_t bits, bool quantized) {
  if (bits != 8 && bits != 4) {
    throw_argument_error(ErrorCode::invalid_argument, op, "moment_bits", "is " + std::to_string(bits) + ", expected 8 or 4");
  }
  if (bits == 4 && !quantized) {
    throw_argument_error(ErrorCode::invalid_argument, op, "moment_bits",
                         "is 4 with exp_avg not u8; expected 8 (the default) unless the moments are u8");
  }
}

void check_absmax_lists(std::string_view op, size_t num_weights, size_t exp_avg_absmax, size_t exp_avg_sq_absmax,
                        bool quantized) {
  const std::pair<std::string_view, size_t> absmax[] = {{"exp_avg_absmax", exp_avg_absmax},
                                                        {"exp_avg_sq_absmax", exp_avg_sq_absmax}};
  for (const auto& [name, count] : absmax) {
    if (quantized && count != num_weights) {
      throw_argument_error(ErrorCode::size_mismatch, op, name,
                           "has " + std::to_string(count) + " tensors, expected " + std::to_string(num_weights) +
                               " (one per tensor: exp_avg is u8)");
    }
    if (!quantized && count != 0) {
      throw_argument_error(ErrorCode::invalid_argument, op, name,
                           "is given, expected none (exp_avg is not u8: the moments are not 8-bit)");
    }
  }
}

}  // namespace gradkit::ops
