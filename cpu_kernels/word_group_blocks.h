// Reading Q8_0 / Q4_0 / Q4_1 blocks grouped by code words for 16 rows (block_formats.h, WordGroups32): a group
// block's scales one row per lane, its 16 pair vectors (the `vpdpwssd` operands of invariant_products.h, read with
// loads, masks and shifts where row-major blocks take a transpose), and the bfloat16 weight tiles of bf16_tiles.h.
#pragma once

#include <cstdint>

#include "block_formats.h"
#include "int16_dots.h"

// 1 where the build multiplies word-grouped weights: AVX-512 with BF16 (the invariant path for few rows, the bf16
// tiles for many).
#if JVLLM_INT16_512 && defined(__AVX512BF16__)
#define JVLLM_WORD_GROUPS 1
#else
#define JVLLM_WORD_GROUPS 0
#endif

#if JVLLM_INT16_512
#include <immintrin.h>

#include "code_tiles.h"

namespace jvllm {

// The first of the two weights whose codes pair p of WordGroupPairs holds (the second is the next weight).
// Q8_0: word t's halves are pairs 2t, 2t + 1. Q4: word t gives the low nibbles' pairs (4t, 4t + 1), (4t + 2, 4t + 3)
// and the high nibbles' (16 + 4t, 17 + 4t), (18 + 4t, 19 + 4t).
template <typename Fmt>
constexpr int WordGroupPairFirst(int p) {
  if constexpr (Fmt::kSigned) {
    return 2 * p;
  } else {
    const int t = p / 4, j = p % 4;
    return 4 * t + 2 * (j & 1) + (j >= 2 ? 16 : 0);
  }
}

// A group block's d and constant c (Q4_1: m; Q4_0: -8 d; Q8_0: 0) for its 16 rows, one per lane.
template <typename Fmt>
inline void WordGroupScales(const uint8_t* block, __m512& d, __m512& c) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  if constexpr (Fmt::kHasMin) {
    c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
  } else {
    c = _mm512_mul_ps(d, _mm512_set1_ps(Fmt::kCodeOffset));
  }
}

// A group block's codes -> pairs[p]: lane r holds row r's codes of weights WordGroupPairFirst(p) and the next one,
// as int16 (the first in the low half).
template <typename Fmt>
inline void WordGroupPairs(const uint8_t* block, __m512i (&pairs)[16]) {
  const uint8_t* codes = block + Fmt::kCodesAt;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  for (int t = 0; t < Fmt::kWords; ++t) {
    const __m512i word = _mm512_loadu_si512(codes + 64 * t);  // bytes 4t, 4t + 2, 4t + 1, 4t + 3 of each row
    if constexpr (Fmt::kSigned) {
      pairs[2 * t] = _mm512_srai_epi16(_mm512_slli_epi16(word, 8), 8);
      pairs[2 * t + 1] = _mm512_srai_epi16(word, 8);
    } else {
      pairs[4 * t] = _mm512_and_si512(word, nibbles);
      pairs[4 * t + 1] = _mm512_and_si512(_mm512_srli_epi32(word, 8), nibbles);
      pairs[4 * t + 2] = _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles);
      pairs[4 * t + 3] = _mm512_and_si512(_mm512_srli_epi32(word, 12), nibbles);
    }
  }
}

#if JVLLM_WORD_GROUPS
// Group n / 16 of word-grouped weights w (K weights a row) -> tile [K / 2, 16] of bf16 pairs, the values
// TileFromCodes (code_tiles.h) makes from the same weights in row-major blocks.
template <typename Fmt>
void TileFromWordGroups(const uint8_t* w, int64_t k, int64_t n, uint32_t* tile) {
  const int64_t blocks = k / Fmt::kWeights;
  const uint8_t* group = w + n / Fmt::kRows * blocks * Fmt::kGroupBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * Fmt::kGroupBytes;
    const char* ahead = reinterpret_cast<const char*>(block + 4 * Fmt::kGroupBytes);
    for (int line = 0; line < Fmt::kGroupBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    __m512 d, c;
    WordGroupScales<Fmt>(block, d, c);
    __m512i pairs[16];
    WordGroupPairs<Fmt>(block, pairs);
    uint32_t* out = tile + b * 16 * 16;  // the block's 16 pairs of all 16 columns
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m512 even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs[p], 16), 16));
      const __m512 odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs[p], 16));
      const __m512i values = Fmt::kSigned ? PairBf16(_mm512_mul_ps(even, d), _mm512_mul_ps(odd, d))
                                          : PairBf16(_mm512_fmadd_ps(even, d, c), _mm512_fmadd_ps(odd, d, c));
      _mm512_storeu_si512(out + WordGroupPairFirst<Fmt>(p) / 2 * 16, values);
    }
  }
}

#endif  // JVLLM_WORD_GROUPS

}  // namespace jvllm

#endif  // JVLLM_INT16_512
