// Few-query attention over 8-bit (e5m2) pages with AVX-512 BF16 dot products (bf16_attention.h's loops), the pages'
// bytes widened in registers.
//
// An e5m2 byte's exponent and mantissa bits, moved 3 places up into a 16-bit lane beside its sign, read as the
// bfloat16 of its value times 2^-112 (bfloat16's exponent bias is 112 above e5m2's): one sign-extending widen, a
// shift and a mask per 32 values. The queries (and the probabilities) go into the products times 2^112, so the sums
// come out unscaled. e5m2 subnormals (below 2^-14) become bfloat16 denormals there, which the dot products take as
// zero; infinities and NaNs read as large finite values. Queries and probabilities are one bfloat16 part each
// (relative error 2^-9), where bfloat16 pages take two (bf16_attention.h): the pages' own rounding (2^-3) dwarfs it,
// and the products' count halves.
#pragma once

#include <cstdint>

#include "bf16_attention.h"
#include "fp8_rows.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace jvllm {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr float kE5m2Scale = 0x1p112f;  // an e5m2 value over what its bits read as in a bfloat16 lane

// 32 e5m2 values -> 32 bfloat16 lanes holding each value times 2^-112: the 8-bit pages' rows for the bf16 loops
// (bf16_attention.h, which take one part of the queries and probabilities for them).
inline __m512i RowChunk(const E5m2* p) {
  const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  // sign-extended: bits 15..8 copy the sign, so the shift puts a sign at bit 15 and the mask keeps it alone
  return _mm512_and_si512(_mm512_slli_epi16(wide, 5), _mm512_set1_epi16(static_cast<int16_t>(0x8FE0)));
}

// out[i] = bf16(x[i] * 2^112), rounded to nearest even; n a multiple of 16.
inline void ScaledToBf16(const float* x, int64_t n, uint16_t* out) {
  const __m512 scale = _mm512_set1_ps(kE5m2Scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(rounded));
  }
}

#else
inline void ScaledToBf16(const float*, int64_t, uint16_t*) {}
#endif

}  // namespace jvllm
