// 8-bit blockwise quantization of optimizer moments (Dettmers et al., "8-bit
// Optimizers via Block-wise Quantization", 2022): each value is stored as one
// byte, the index of the nearest entry of a 256-entry code table after
// dividing by its block's absolute maximum, kept as one f32 per block.
// docs/ops.md ("8-bit moments") states the tables and the rounding.
#pragma once

#include <array>
#include <cstdint>

#include "gradkit/core/tensor.h"

namespace gradkit {

// Elements per quantization block: the one place the block size is set.
// Blocks start at element 0 of each tensor and never straddle two tensors;
// the last block of a tensor may be short.
inline constexpr int32_t kQuantBlock = 256;

// The number of blocks (and absmax values) a tensor of `numel` elements has.
constexpr int64_t quant_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

// The two code tables: the signed dynamic map (first moments), the unsigned
// dynamic map (second moments, never negative).
enum class QuantCode : int32_t { signed_dynamic = 0, unsigned_dynamic = 1 };

// The table's 256 values, ascending, each in [-1, 1], built from the
// paper's definition (docs/ops.md).
const std::array<float, 256>& quant_code(QuantCode code);

// Encodes `values` (f32) block by block into `codes` (u8, as many elements)
// and `absmax` (f32, quant_blocks(values.numel) elements), exactly as the
// optimizer kernels do; and back. For moving state between the 8-bit form
// and f32 (a state file, torch.optim's state): tensors on a CUDA device are
// staged through host memory, synchronously. Validates sizes, dtypes and
// devices first, naming the argument.
void quantize_blockwise(QuantCode code, const TensorView& values, const TensorView& codes, const TensorView& absmax);
void dequantize_blockwise(QuantCode code, const TensorView& codes, const TensorView& absmax, const TensorView& values);

// 4-bit blockwise moments (Li et al., "Memory Efficient Optimizers with
// 4-bit States", 2023): two codes a byte (element 2k in the low nibble),
// each the index of the nearest entry of a 16-entry table after scaling by
// its block's 1 / absmax, with one f32 absmax per block of kQuant4Block
// elements. docs/ops.md ("4-bit moments") states the tables.
inline constexpr int32_t kQuant4Block = 128;
constexpr int64_t quant4_blocks(int64_t numel) { return (numel + kQuant4Block - 1) / kQuant4Block; }
// Bytes of a 4-bit tensor of `numel` codes.
constexpr int64_t quant4_bytes(int64_t numel) { return (numel + 1) / 2; }

// The elements one stored value stands for in a list of `bits`-bit moments
// (8 or 4): a byte of codes (1, or 2 for two 4-bit codes), an absmax (its block).
constexpr int32_t elements_per_code_byte(int32_t bits) { return bits == 4 ? 2 : 1; }
constexpr int32_t quant_block_of(int32_t bits) { return bits == 4 ? kQuant4Block : kQuantBlock; }

// The two 4-bit tables: signed_dynamic is the dynamic map with 3 decimal
// exponents (first moments); unsigned_dynamic the unsigned one over 3
// decades without zero (second moments: the code 0 stands for the smallest
// positive value, 0.00325, so no positive v is stored as 0). docs/ops.md
// ("4-bit moments") gives the values and why this map.
const std::array<float, 16>& quant_code4(QuantCode code);

// quantize_blockwise / dequantize_blockwise for the 4-bit form: `codes` is
// u8 with quant4_bytes(values.numel) elements, `absmax` f32 with
// quant4_blocks(values.numel).
void quantize_blockwise4(QuantCode code, const TensorView& values, const TensorView& codes, const TensorView& absmax);
void dequantize_blockwise4(QuantCode code, const TensorView& codes, const TensorView& absmax,
                           const TensorView& values);

}  // namespace gradkit
