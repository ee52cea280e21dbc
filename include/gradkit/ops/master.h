// An f32 master weight stored in 2 bytes beside its bf16 weight: the weight
// is the master rounded to nearest (ties away from zero), the remainder (i16)
// what that rounding took away, so that the pair gives the master back bit
// for bit (docs/ops.md, "the remainder master"). adam_step updates such
// pairs in place (AdamTensors::weight_remainder); these convert whole
// tensors to and from f32 masters, e.g. to load or export state.
#pragma once

#include "gradkit/core/tensor.h"

namespace gradkit {

// masters (f32) -> weights (bf16) and remainder (i16), all of one size and
// device; tensors on a CUDA device are staged through host memory,
// synchronously. Validates first, naming the argument.
void split_masters(const TensorView& masters, const TensorView& weights, const TensorView& remainder);
// weights (bf16) and remainder (i16) -> masters (f32).
void join_masters(const TensorView& weights, const TensorView& remainder, const TensorView& masters);

}  // namespace gradkit
