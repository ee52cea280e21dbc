// The 8- and 4-bit moments' table lookups in AVX-512, for the AVX-512 copy
// of the CPU Adam kernel (adam_low_bit.h). GCC 12 vectorizes these loops but, under
// its generic tuning, emulates each gather with 16 scalar loads; the
// permutes (the 256-entry tables) and the gather (the buckets' starts) here
// compute the same codes and values as
// quantize() and dequantize() (spec/low_bit_int8_math.h), bit for bit
// (tests/test_cpu_isa_adam.cc). Compiled only where isa.h has its copies.
#pragma once

#include "cpu/isa.h"

#if GRADKIT_CPU_MULTI_ISA
// GCC 12's AVX-512 intrinsics initialise a value from itself (__Y = __Y),
// which -W(maybe-)uninitialized reports in every function that inlines them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstdint>

#include "spec/low_bit_int4_math.h"
#include "spec/low_bit_int8_math.h"

namespace gradkit::cpu {

#define GRADKIT_AVX512 __attribute__((target("arch=x86-64-v4")))

// A 256-float table in 16 registers, for lookup256.
struct Table256 {
  __m512 part[16];
};

GRADKIT_AVX512 inline Table256 load_table256(const float* table) {
  Table256 t;
  for (int j = 0; j < 16; ++j) t.part[j] = _mm512_loadu_ps(table + 16 * j);
  return t;
}

// table[index[i]] for 16 indices in [0, 256), the same values a gather
// reads: a two-register permute per 32 entries (the index's low 5 bits),
// then three blends on its bits 5, 6 and 7. Permutes run at one a cycle,
// where a gather of 16 costs tens of cycles (microcode, on CPUs with the
// gather-data-sampling mitigation): gathers would be most of the 8-bit
// step's time on the CPU (measured: bench/log/2026-11-26.md, "CPU 8-bit
// Adam: the tables read by permutes").
GRADKIT_AVX512 inline __m512 lookup256(const Table256& t, __m512i index) {
  __m512 r[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm512_permutex2var_ps(t.part[2 * j], index, t.part[2 * j + 1]);
  const __mmask16 b5 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(128));
  const __m512 s0 = _mm512_mask_blend_ps(b5, r[0], r[1]), s1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
  const __m512 s2 = _mm512_mask_blend_ps(b5, r[4], r[5]), s3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
  return _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, s0, s1), _mm512_mask_blend_ps(b6, s2, s3));
}

// out[i] = codes[q[i]] * absmax for i < n.
GRADKIT_AVX512 inline void decode_avx512(const spec::QuantTable& t, const uint8_t* q, float absmax, int n,
                                         float* out) {
  const __m512 scale = _mm512_set1_ps(absmax);
  const Table256 codes = load_table256(t.codes);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(lookup256(codes, index), scale));
  }
  for (; i < n; ++i) out[i] = spec::dequantize(t, q[i], absmax);
}

// out[k] = codes[nibble k] * absmax for the n elements of a 4-bit block
// whose bytes start at q (element 0 in the low nibble of q[0]): 16 elements
// from 8 bytes, their nibbles interleaved low, high, low, ... into element
// order, then one permute for the 16-entry table (dequantize4's values).
GRADKIT_AVX512 inline void decode4_avx512(const spec::QuantTable4& t, const uint8_t* q, float absmax, int n,
                                          float* out) {
  const __m512 scale = _mm512_set1_ps(absmax);
  const __m512 codes = _mm512_loadu_ps(t.codes);
  const __m128i low_nibble = _mm_set1_epi8(0x0f);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i / 2));
    const __m128i low = _mm_and_si128(bytes, low_nibble);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble);
    const __m512i index = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_permutexvar_ps(index, codes), scale));
  }
  for (; i < n; ++i) out[i] = spec::dequantize4(t, spec::code4_at(q, i), absmax);
}

// encode_block (spec/low_bit_tables.h) with the search's table reads
// gathered: the absmax as the integer max of the magnitudes' bits, then
// each code from its bucket's start and kQuantSpan comparisons, then the
// NaN rule (this copy clamps magnitudes to 1 and masks NaN, where quantize
// clamps them into 2.0's bucket: the same codes).
GRADKIT_AVX512 inline void encode_avx512(const spec::QuantTable& t, const float* values, int n, uint8_t* codes,
                                         float* absmax) {
  const __m512i sign_off = _mm512_set1_epi32(0x7fffffff);
  __m512i top16 = _mm512_setzero_si512();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    top16 = _mm512_max_epu32(top16, _mm512_and_si512(_mm512_loadu_si512(values + i), sign_off));
  }
  uint32_t top = _mm512_reduce_max_epu32(top16);
  for (; i < n; ++i) top = spec::absmax_bits_fold(top, spec::magnitude_bits(values[i]));
  const float amax = spec::bits_float(top);
  const float scale = spec::quant_scale(amax);

  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i one_bits = _mm512_set1_epi32(0x3f800000), lowest = _mm512_set1_epi32(spec::kQuantLowestBits);
  const __m512i buckets = _mm512_set1_epi32(spec::kQuantBuckets), low_byte = _mm512_set1_epi32(0xff);
  const __m512i one = _mm512_set1_epi32(1);
  const Table256 midpoints = load_table256(t.midpoints);
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values + i), vscale);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i magnitude = _mm512_min_epu32(_mm512_and_si512(bits, sign_off), one_bits);
    // quant_bucket: magnitude > lowest ? magnitude - lowest : 0, shifted.
    const __m512i above = _mm512_sub_epi32(_mm512_max_epu32(magnitude, lowest), lowest);
    const __m512i bucket = _mm512_add_epi32(_mm512_srli_epi32(above, 23 - spec::kQuantMantissaBits),
                                            _mm512_mullo_epi32(_mm512_srli_epi32(bits, 31), buckets));
    // start[] is bytes: a 4-byte gather at each byte's address, the low byte
    // kept (the buckets in use lie far below the array's end).
    __m512i q = _mm512_and_si512(_mm512_i32gather_epi32(bucket, t.start, 1), low_byte);
    for (int k = 0; k < spec::kQuantSpan; ++k) {
      const __mmask16 above_point = _mm512_cmp_ps_mask(x, lookup256(midpoints, q), _CMP_GT_OQ);
      q = _mm512_mask_add_epi32(q, above_point, q, one);
    }
    q = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), q);  // NaN gives 0
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(q));
  }
  for (; i < n; ++i) codes[i] = spec::quantize(t, spec::exact::mul(values[i], scale));
  *absmax = amax;
}

#undef GRADKIT_AVX512

}  // namespace gradkit::cpu
#pragma GCC diagnostic pop
#endif
