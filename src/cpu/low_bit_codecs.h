// The two forms of blockwise moments as the CPU kernels meet them (the Adam
// kernel, cpu/adam_low_bit.h; LAMB's passes, cpu/lamb_low_bit.h): a block's
// codes decoded into floats, and a block's floats encoded into codes with
// their new absmax, with AVX-512's permutes in the AVX-512 copy
// (low_bit_avx512.h) for the decodes and the 8-bit encode, else as loops that
// GCC vectorizes as it can (the 4-bit encode's count of the 15 decision
// points below each value vectorizes as written). Either way the codes and
// values of spec/low_bit_int8_math.h and low_bit_int4_math.h, bit for bit.
#pragma once

#include <cstdint>

#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_tables.h"
#include "cpu/isa.h"
#include "cpu/low_bit_avx512.h"

namespace gradkit::spec::cpu_low_bit {

// The 8-bit form: kQuantBlock elements a block, one code a byte.
struct Codec8 {
  static constexpr int kBlock = kQuantBlock;
  static constexpr int kCodesPerByte = 1;
  const QuantTables* tables;
  bool avx512;
  // The codec of a launch (AdamLaunch, LambLaunch: its `tables`) run in `isa`'s copy.
  template <class Launch>
  static Codec8 of(const Launch& l, cpu::Isa isa) {
    return {l.tables, isa == cpu::Isa::avx512};
  }
  // n values of the block from element `base` of `codes`.
  void decode(int moment, const uint8_t* codes, int64_t base, float absmax, int n, float* out) const {
    const QuantTable& t = tables->table[moment];
#if GRADKIT_CPU_MULTI_ISA
    if (avx512) return cpu::decode_avx512(t, codes + base, absmax, n, out);
#endif
    for (int k = 0; k < n; ++k) out[k] = dequantize(t, codes[base + k], absmax);
  }
  // The block's n values encoded from element `base` of `codes`; its absmax.
  void encode(int moment, const float* values, int n, uint8_t* codes, int64_t base, float* absmax) const {
    const QuantTable& t = tables->table[moment];
#if GRADKIT_CPU_MULTI_ISA
    if (avx512) return cpu::encode_avx512(t, values, n, codes + base, absmax);
#endif
    encode_block(t, values, n, codes + base, absmax);
  }
};

// The 4-bit form (spec/low_bit_int4_math.h): kQuant4Block elements a block,
// two codes a byte; a block starts on an even element, so on a byte.
struct Codec4 {
  static constexpr int kBlock = kQuant4Block;
  static constexpr int kCodesPerByte = 2;
  const QuantTables4* tables;
  bool avx512;
  template <class Launch>
  static Codec4 of(const Launch& l, cpu::Isa isa) {
    return {l.tables4, isa == cpu::Isa::avx512};
  }
  void decode(int moment, const uint8_t* codes, int64_t base, float absmax, int n, float* out) const {
    const QuantTable4& t = tables->table[moment];
#if GRADKIT_CPU_MULTI_ISA
    if (avx512) return cpu::decode4_avx512(t, codes + base / 2, absmax, n, out);
#endif
    for (int k = 0; k < n; ++k) out[k] = dequantize4(t, code4_at(codes, base + k), absmax);
  }
  void encode(int moment, const float* values, int n, uint8_t* codes, int64_t base, float* absmax) const {
    uint8_t c[kQuant4Block];
    *absmax = encode_block4(tables->table[moment], values, n, c);
    store_block4(c, n, codes, base);
  }
};

// The bytes that hold a block of n codes.
template <class Codec>
constexpr int block_bytes(int n) {
  return (n + Codec::kCodesPerByte - 1) / Codec::kCodesPerByte;
}

}  // namespace gradkit::spec::cpu_low_bit
