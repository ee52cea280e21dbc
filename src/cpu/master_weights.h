// How the CPU optimizer kernels (Adam, LAMB) read and write their master
// weights: stored as they are (f32, f64), or as bf16 weights completed to an
// f32 master by the remainder list (spec/master_math.h). The element
// loops are templates on one of these, so the choice is made once per launch.
#pragma once

#include <cstdint>
#include <type_traits>

#include "spec/master_math.h"
#include "cpu/multi_tensor.h"
#include "cpu/types.h"

namespace gradkit::spec::cpu_master {

// Weights stored as they are (f32, f64).
template <class W>
struct PlainWeights {
  using C = cpu::compute_t<W>;
  using Stored = W;
  static C load(const W* w, const int16_t*, int64_t i) { return cpu::to_compute<C>(w[i]); }
  static void store(W* w, int16_t*, int64_t i, C x) { w[i] = cpu::from_compute<W>(x); }
};

// bf16 weights (their bits) whose f32 master is completed by the remainder
// list (master_math.h).
struct RemainderWeights {
  using C = float;
  using Stored = uint16_t;
  static float load(const uint16_t* w, const int16_t* r, int64_t i) { return join_master(w[i], r[i]); }
  static void store(uint16_t* w, int16_t* r, int64_t i, float x) { split_master(x, w[i], r[i]); }
};

// The chunk's remainder list (the launch's remainder_list), or null for
// plain weights.
template <class Weights, class Launch>
int16_t* remainder_of(const cpu::ChunkView& chunk, const Launch& launch) {
  if constexpr (std::is_same_v<Weights, RemainderWeights>) return chunk.tensor<int16_t>(launch.remainder_list);
  else return nullptr;
}

// The model copy the kernels may write beside the masters (f16 or bf16), or
// NoCopy when the launch writes none: a type fixed per launch, so that no
// element loop asks.
struct NoCopy {};

// The chunk's model copy (the launch's copy_list), or null.
template <class Copy, class Launch>
Copy* copy_of(const cpu::ChunkView& chunk, const Launch& launch) {
  if constexpr (std::is_same_v<Copy, NoCopy>) return nullptr;
  else return chunk.tensor<Copy>(launch.copy_list);
}

// Element i of the copy: the master rounded from f32 (an f64 master through
// f32, as CUDA's conversions go); nothing for NoCopy.
template <class Copy, class C>
inline void store_copy(Copy* copy, int64_t i, C x) {
  if constexpr (!std::is_same_v<Copy, NoCopy>) copy[i] = cpu::from_compute<Copy>(static_cast<float>(x));
}

}  // namespace gradkit::spec::cpu_master
