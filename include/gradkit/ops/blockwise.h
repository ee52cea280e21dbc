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

}  // namespace gradkit
