// The encoded forms of optimizer state: 8-bit blockwise moments and the
// remainder master (gradkit/ops/low_bit.h, gradkit/ops/master.h), so that
// state can be moved between gradkit's compact form and float32 (a
// torch.optim state_dict, a checkpoint) with the kernels' own formulas.
#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings.h"
#include "gradkit/ops/low_bit.h"
#include "gradkit/ops/master.h"
#include "tensors.h"

namespace gradkit::python {

void bind_state(nb::module_& m) {
  nb::enum_<QuantCode>(m, "QuantCode", "The 8-bit code tables: signed_dynamic (first moments), "
                                       "unsigned_dynamic (second moments).")
      .value("signed_dynamic", QuantCode::signed_dynamic)
      .value("unsigned_dynamic", QuantCode::unsigned_dynamic);
  m.attr("QUANT_BLOCK") = kQuantBlock;
  m.def("quant_blocks", &quant_blocks, nb::arg("numel"),
        "The number of quantization blocks (and absmax values) of a tensor of `numel` elements.");
  m.def(
      "quant_code",
      [](QuantCode code) {
        const auto& table = quant_code(code);
        return std::vector<float>(table.begin(), table.end());
      },
      nb::arg("code"), "The code table's 256 values, ascending (docs/ops.md, 8-bit moments).");
  m.def(
      "quantize_blockwise",
      [](QuantCode code, const Array& values, const Array& codes, const Array& absmax) {
        quantize_blockwise(code, to_view(values, "values"), to_view(codes, "codes"), to_view(absmax, "absmax"));
      },
      nb::arg("code"), nb::arg("values"), nb::arg("codes"), nb::arg("absmax"),
      "values (float32) -> codes (uint8, as many elements) and absmax (float32, quant_blocks(numel)), as the "
      "optimizer kernels encode 8-bit moments. Synchronous.");
  m.def(
      "dequantize_blockwise",
      [](QuantCode code, const Array& codes, const Array& absmax, const Array& values) {
        dequantize_blockwise(code, to_view(codes, "codes"), to_view(absmax, "absmax"), to_view(values, "values"));
      },
      nb::arg("code"), nb::arg("codes"), nb::arg("absmax"), nb::arg("values"),
      "codes (uint8) and absmax (float32) -> values (float32). Synchronous.");
  m.attr("QUANT4_BLOCK") = kQuant4Block;
  m.def("quant4_blocks", &quant4_blocks, nb::arg("numel"),
        "The number of 4-bit quantization blocks (and absmax values) of a tensor of `numel` elements.");
  m.def("quant4_bytes", &quant4_bytes, nb::arg("numel"), "Bytes of `numel` 4-bit codes (two a byte).");
  m.def(
      "quant_code4",
      [](QuantCode code) {
        const auto& table = quant_code4(code);
        return std::vector<float>(table.begin(), table.end());
      },
      nb::arg("code"),
      "The 4-bit table's 16 values, ascending: signed_dynamic (first moments), unsigned_dynamic the unsigned "
      "dynamic map without zero, DE-0 (second moments; codes 0 and 1 both stand for its smallest value; "
      "docs/ops.md, 4-bit moments).");
  m.def(
      "quantize_blockwise4",
      [](QuantCode code, const Array& values, const Array& codes, const Array& absmax) {
        quantize_blockwise4(code, to_view(values, "values"), to_view(codes, "codes"), to_view(absmax, "absmax"));
      },
      nb::arg("code"), nb::arg("values"), nb::arg("codes"), nb::arg("absmax"),
      "values (float32) -> codes (uint8, quant4_bytes(numel)) and absmax (float32, quant4_blocks(numel)), as the "
      "optimizer kernels encode 4-bit moments. Synchronous.");
  m.def(
      "dequantize_blockwise4",
      [](QuantCode code, const Array& codes, const Array& absmax, const Array& values) {
        dequantize_blockwise4(code, to_view(codes, "codes"), to_view(absmax, "absmax"), to_view(values, "values"));
      },
      nb::arg("code"), nb::arg("codes"), nb::arg("absmax"), nb::arg("values"),
      "codes (uint8, two a byte) and absmax (float32) -> values (float32, as many as the tensor has). Synchronous.");
  m.def(
      "split_masters",
      [](const Array& masters, const Array& weights, const Array& remainder) {
        split_masters(to_view(masters, "masters"), to_view(weights, "weights"), to_view(remainder, "remainder"));
      },
      nb::arg("masters"), nb::arg("weights"), nb::arg("remainder"),
      "float32 masters -> bfloat16 weights (rounded to nearest, ties away from zero) and their int16 remainder, "
      "which together give the masters back bit for bit. Synchronous.");
  m.def(
      "join_masters",
      [](const Array& weights, const Array& remainder, const Array& masters) {
        join_masters(to_view(weights, "weights"), to_view(remainder, "remainder"), to_view(masters, "masters"));
      },
      nb::arg("weights"), nb::arg("remainder"), nb::arg("masters"),
      "bfloat16 weights and their int16 remainder -> the float32 masters. Synchronous.");
}

}  // namespace gradkit::python
