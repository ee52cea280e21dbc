// The code tables of 8-bit moments, built from their definition, and the
// whole-tensor encode/decode for moving state in and out of the 8-bit form.
#include "gradkit/ops/low_bit.h"

#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "spec/low_bit_int8_math.h"
#include "spec/low_bit_tables.h"
#include "gradkit/core/error.h"
#include "gradkit/core/memory.h"
#include "ops/host_staging.h"

namespace gradkit {
namespace {

// The dynamic map of Dettmers (2016, "8-Bit Approximations for Parallelism
// in Deep Learning") over `decades` decimal exponents from `lowest`
// (10^-(decades - 1)) up: for the k-th exponent, the midpoints of n equal
// steps of [0.1, 1] times 10^e, where n doubles with k (1, 2, 4, ... for the
// signed map, which takes each value with both signs; 2, 4, ... for the
// unsigned map, which has the sign bit as one more fraction bit); then 0
// and 1, ascending, in f64. The 8-bit maps take 7 decades (2^7 - 1 or
// 2^8 - 2 values plus 2: 256 either way); the 4-bit first moment's signed
// map 3 (Li et al. 2023: 7 + 7 + 2 values).
std::vector<double> dynamic_map(bool is_signed, int decades, double lowest) {
  std::vector<double> values;
  double decade = lowest;
  for (int e = 0; e < decades; ++e, decade *= 10) {
    const int steps = is_signed ? (1 << e) : (2 << e);
    for (int i = 0; i < steps; ++i) {
      const double low = 0.1 + 0.9 * i / steps, high = 0.1 + 0.9 * (i + 1) / steps;
      const double value = decade * ((low + high) / 2);
      values.push_back(value);
      if (is_signed) values.push_back(-value);
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::sort(values.begin(), values.end());
  return values;
}

// A map's values rounded to f32 once.
template <size_t N>
std::array<float, N> rounded(const std::vector<double>& values) {
  std::array<float, N> code{};
  for (size_t i = 0; i < N; ++i) code[i] = static_cast<float>(values.at(i));
  return code;
}

std::array<float, 256> build_code(bool is_signed) { return rounded<256>(dynamic_map(is_signed, 7, 1e-6)); }

// Each bucket's start (spec::bucketed_count): the binary search's count
// at the bucket's lowest value, checking that its highest lies at most
// kQuantSpan decision points further (else the encode would stop short: a
// logic error). Past 1 every decision point lies below a positive x and
// above a negative one (N - 1 and 0); from 2.0's bucket on (only NaN reaches
// it: the encode clamps magnitudes there) 0 for both signs. One definition
// for both forms (QuantTable, QuantTable4), each with its own buckets.
template <class Table>
void fill_bucket_starts(Table& t) {
  using Buckets = typename Table::Buckets;
  constexpr int kLast = static_cast<int>(std::extent_v<decltype(Table::midpoints)>) - 1;
  const auto count = [&t](float x) { return static_cast<int>(spec::count_below(t.midpoints, x)); };
  const uint32_t one = spec::float_bits(1.0f);
  for (int b = 0; b < Buckets::kCount; ++b) {
    const uint32_t step = 1u << Buckets::kShift;
    const uint32_t low = b == 0 ? 0u : Buckets::kLowestBits + static_cast<uint32_t>(b) * step;
    const uint32_t high = std::min(Buckets::kLowestBits + static_cast<uint32_t>(b + 1) * step - 1, one);
    if (low > one) {
      t.start[b] = low < spec::kQuantNanBits ? kLast : 0;
      t.start[Buckets::kCount + b] = 0;
      continue;
    }
    const float small = spec::bits_float(low), large = spec::bits_float(high);
    const int positive = count(small), negative = count(-large);
    if (count(large) - positive > spec::kQuantSpan || count(-small) - negative > spec::kQuantSpan) {
      throw Error(ErrorCode::invalid_argument, "quant_code: a search bucket holds more than kQuantSpan decision "
                                               "points (the table's buckets are too coarse for it)");
    }
    t.start[b] = static_cast<uint8_t>(positive);
    t.start[Buckets::kCount + b] = static_cast<uint8_t>(negative);
  }
}

// The 4-bit tables (Li et al. 2023): the signed dynamic map with 3 decimal
// exponents (first moments); the unsigned one without zero, "DE-0" (second
// moments): 2 + 4 + 8 values over 3 decades, then 1, with code 0 taking the
// smallest positive value in place of 0 (so codes 0 and 1 stand for the
// same value), as the paper's code builds it.
std::array<float, 16> build_code4(bool is_signed) {
  std::vector<double> values = dynamic_map(is_signed, 3, 1e-2);
  if (!is_signed) values[0] = values[1];
  return rounded<16>(values);
}

spec::QuantTable4 build_table4(const std::array<float, 16>& code) {
  spec::QuantTable4 t{};
  for (int i = 0; i < 16; ++i) t.codes[i] = code[i];
  for (int i = 0; i < 15; ++i) {
    t.midpoints[i] = static_cast<float>((static_cast<double>(code[i]) + static_cast<double>(code[i + 1])) / 2);
  }
  t.midpoints[15] = std::numeric_limits<float>::infinity();
  fill_bucket_starts(t);
  for (int b = 0; b < 256; ++b) {
    for (int h = 0; h < 2; ++h) t.pairs[b][h] = t.codes[spec::nibble(static_cast<uint8_t>(b), h)];
  }
  return t;
}

// `positive_floor`: the unsigned map's rule (spec::QuantTable): its
// first decision point is 0, so a positive value counts at least one.
spec::QuantTable build_table(const std::array<float, 256>& code, bool positive_floor) {
  spec::QuantTable t{};
  for (int i = 0; i < 256; ++i) t.codes[i] = code[i];
  for (int i = 0; i < 255; ++i) {
    t.midpoints[i] = static_cast<float>((static_cast<double>(code[i]) + static_cast<double>(code[i + 1])) / 2);
  }
  if (positive_floor) t.midpoints[0] = 0.0f;
  t.midpoints[255] = std::numeric_limits<float>::infinity();
  fill_bucket_starts(t);
  return t;
}

constexpr std::string_view kQuantize = "quantize_blockwise";
constexpr std::string_view kDequantize = "dequantize_blockwise";
constexpr std::string_view kQuantize4 = "quantize_blockwise4";
constexpr std::string_view kDequantize4 = "dequantize_blockwise4";

void check_code(std::string_view op, QuantCode code) {
  const auto c = static_cast<int32_t>(code);
  if (c != 0 && c != 1) {
    throw_argument_error(ErrorCode::invalid_argument, op, "code",
                         "is " + std::to_string(c) + ", expected signed_dynamic or unsigned_dynamic");
  }
}

// The arguments of the 4-bit whole-tensor encode and decode: the element
// count is the values' (the codes hold two a byte).
void check_4bit(std::string_view op, QuantCode code, const TensorView& values, const TensorView& codes,
                const TensorView& absmax) {
  check_code(op, code);
  const Device device = values.device;
  ops::check_staged(op, "values", values, DType::f32, values.numel, device);
  ops::check_staged(op, "codes", codes, DType::u8, quant4_bytes(values.numel), device);
  ops::check_staged(op, "absmax", absmax, DType::f32, quant4_blocks(values.numel), device);
}

}  // namespace

const std::array<float, 256>& quant_code(QuantCode code) {
  static const std::array<float, 256> tables[2] = {build_code(true), build_code(false)};
  check_code("quant_code", code);
  return tables[static_cast<int>(code)];
}

const std::array<float, 16>& quant_code4(QuantCode code) {
  static const std::array<float, 16> tables[2] = {build_code4(true), build_code4(false)};
  check_code("quant_code4", code);
  return tables[static_cast<int>(code)];
}

namespace spec {

const QuantTables4& quant_tables4() {
  static const QuantTables4 tables = [] {
    QuantTables4 t{};
    t.table[0] = build_table4(quant_code4(QuantCode::signed_dynamic));
    t.table[1] = build_table4(quant_code4(QuantCode::unsigned_dynamic));
    return t;
  }();
  return tables;
}

const QuantTables& quant_tables() {
  static const QuantTables tables = [] {
    QuantTables t{};
    t.table[0] = build_table(quant_code(QuantCode::signed_dynamic), false);
    t.table[1] = build_table(quant_code(QuantCode::unsigned_dynamic), true);
    return t;
  }();
  return tables;
}

}  // namespace spec

void quantize_blockwise(QuantCode code, const TensorView& values, const TensorView& codes, const TensorView& absmax) {
  check_code(kQuantize, code);
  const Device device = values.device;
  ops::check_staged(kQuantize, "values", values, DType::f32, values.numel, device);
  ops::check_staged(kQuantize, "codes", codes, DType::u8, values.numel, device);
  ops::check_staged(kQuantize, "absmax", absmax, DType::f32, quant_blocks(values.numel), device);
  const std::vector<float> x = ops::to_host<float>(values);
  std::vector<uint8_t> q(x.size());
  std::vector<float> amax(static_cast<size_t>(absmax.numel));
  const spec::QuantTable& table = spec::quant_tables().table[static_cast<int>(code)];
  for (int64_t b = 0; b < absmax.numel; ++b) {
    const int64_t begin = b * kQuantBlock;
    const int n = static_cast<int>(std::min<int64_t>(kQuantBlock, values.numel - begin));
    spec::encode_block(table, x.data() + begin, n, q.data() + begin, &amax[b]);
  }
  copy_from_host(codes.data, device, q.data(), q.size());
  copy_from_host(absmax.data, device, amax.data(), amax.size() * sizeof(float));
}

void dequantize_blockwise(QuantCode code, const TensorView& codes, const TensorView& absmax, const TensorView& values) {
  check_code(kDequantize, code);
  const Device device = codes.device;
  ops::check_staged(kDequantize, "codes", codes, DType::u8, codes.numel, device);
  ops::check_staged(kDequantize, "absmax", absmax, DType::f32, quant_blocks(codes.numel), device);
  ops::check_staged(kDequantize, "values", values, DType::f32, codes.numel, device);
  const std::vector<uint8_t> q = ops::to_host<uint8_t>(codes);
  const std::vector<float> amax = ops::to_host<float>(absmax);
  std::vector<float> x(q.size());
  const spec::QuantTable& table = spec::quant_tables().table[static_cast<int>(code)];
  for (size_t i = 0; i < x.size(); ++i) x[i] = spec::dequantize(table, q[i], amax[i / kQuantBlock]);
  copy_from_host(values.data, device, x.data(), x.size() * sizeof(float));
}

void quantize_blockwise4(QuantCode code, const TensorView& values, const TensorView& codes, const TensorView& absmax) {
  check_4bit(kQuantize4, code, values, codes, absmax);
  const Device device = values.device;
  const std::vector<float> x = ops::to_host<float>(values);
  std::vector<uint8_t> q(static_cast<size_t>(quant4_bytes(values.numel)), 0);
  std::vector<float> amax(static_cast<size_t>(absmax.numel));
  const spec::QuantTable4& table = spec::quant_tables4().table[static_cast<int>(code)];
  uint8_t block_codes[kQuant4Block];
  for (int64_t b = 0; b < absmax.numel; ++b) {
    const int64_t begin = b * kQuant4Block;
    const int n = static_cast<int>(std::min<int64_t>(kQuant4Block, values.numel - begin));
    amax[b] = spec::encode_block4(table, x.data() + begin, n, block_codes);
    spec::store_block4(block_codes, n, q.data(), begin);
  }
  copy_from_host(codes.data, device, q.data(), q.size());
  copy_from_host(absmax.data, device, amax.data(), amax.size() * sizeof(float));
}

void dequantize_blockwise4(QuantCode code, const TensorView& codes, const TensorView& absmax,
                           const TensorView& values) {
  check_4bit(kDequantize4, code, values, codes, absmax);
  const Device device = codes.device;
  const std::vector<uint8_t> q = ops::to_host<uint8_t>(codes);
  const std::vector<float> amax = ops::to_host<float>(absmax);
  std::vector<float> x(static_cast<size_t>(values.numel));
  const spec::QuantTable4& table = spec::quant_tables4().table[static_cast<int>(code)];
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = spec::dequantize4(table, spec::code4_at(q.data(), static_cast<int64_t>(i)), amax[i / kQuant4Block]);
  }
  copy_from_host(values.data, device, x.data(), x.size() * sizeof(float));
}

}  // namespace gradkit
