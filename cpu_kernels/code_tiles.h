// bfloat16 weight tiles of the 32-weight block formats (Q8_0, Q4_0, Q4_1) made from their codes transposed: the 16
// rows' code bytes of a block are transposed as 16-bit words (the codes of a pair of weights) first, so every pair
// vector of the tile (pair p of all 16 rows) is dequantized where it lands. Dequantizing rows and transposing the
// bfloat16 pairs afterwards moves four times the bytes through the shuffles; for steps of 9-64 rows, where each
// weight meets few rows of x, making the tiles is a large part of a product's time.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "block_formats.h"

namespace jvllm {

template <typename Fmt>
constexpr bool kTilesFromCodes =
    std::is_same_v<Fmt, Q8_0> || std::is_same_v<Fmt, Q4_0> || std::is_same_v<Fmt, Q4_1>;

// Words 0-7 of 16 rows' 16 code bytes (rows[r] + offset) -> words[j]: word j of row r in 32-bit lane r (zero-extended).
inline void TransposeCodeWords(const uint8_t* const (&rows)[16], int64_t offset, __m512i (&words)[8]) {
  __m512i quads[4];  // quads[r]: rows r, r + 4, r + 8, r + 12 in its four 128-bit lanes
  for (int r = 0; r < 4; ++r) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + offset)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r + 4] + offset)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r + 8] + offset)), 2);
    quads[r] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r + 12] + offset)), 3);
  }
  // per 128-bit lane L (rows 4L .. 4L + 3): words interleaved by row pairs, then by row quads
  const __m512i lo01 = _mm512_unpacklo_epi16(quads[0], quads[1]), hi01 = _mm512_unpackhi_epi16(quads[0], quads[1]);
  const __m512i lo23 = _mm512_unpacklo_epi16(quads[2], quads[3]), hi23 = _mm512_unpackhi_epi16(quads[2], quads[3]);
  const __m512i by_word[4] = {  // [k]: word 2k of the lane's 4 rows (64 bits), then word 2k + 1
      _mm512_unpacklo_epi32(lo01, lo23), _mm512_unpackhi_epi32(lo01, lo23),
      _mm512_unpacklo_epi32(hi01, hi23), _mm512_unpackhi_epi32(hi01, hi23)};
  const __m512i gather = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);  // each lane's first halves, then second
  for (int k = 0; k < 4; ++k) {
    const __m512i rows_in_order = _mm512_permutexvar_epi64(gather, by_word[k]);
    words[2 * k] = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(rows_in_order));
    words[2 * k + 1] = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(rows_in_order, 1));
  }
}

// Per-lane weights (even, odd) rounded to bfloat16 as 32-bit pairs, the even weight in the low half.
inline __m512i PairBf16(__m512 even, __m512 odd) {
  alignas(64) static constexpr uint16_t kOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512bh both = _mm512_cvtne2ps_pbh(odd, even);  // 16-bit elements: even 0-15, then odd 0-15
  return _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), reinterpret_cast<const __m512i&>(both));
}

// Rows [n, n + cols) of w (cols <= 16; the rest of the tile's columns are 0) -> tile [K / 2, 16] of bf16 pairs.
template <typename Fmt>
void TileFromCodes(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n, int cols, uint32_t* tile) {
  constexpr int64_t kHeader = Fmt::kBytes - (std::is_same_v<Fmt, Q8_0> ? 32 : 16);  // bytes before the codes
  const uint8_t* rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = w + (n + (r < cols ? r : 0)) * row_bytes;
  // each row's block header (d, and Q4_1's m) as one 32-bit lane, zero in the columns past `cols`
  const __m512i header_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1u);
  for (int64_t block = 0; block < k / 32; ++block) {
    const int64_t at = block * Fmt::kBytes;
    const uint8_t* next_tile = w + (n + 16) * row_bytes + at;  // the caller's next tile, most often
    for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(next_tile + r * row_bytes), _MM_HINT_T0);
    const __m512i header =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, header_at, w + n * row_bytes + at, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header));
    uint32_t* out = tile + block * 16 * 16;  // the block's 16 pairs
    if constexpr (std::is_same_v<Fmt, Q8_0>) {
      for (int half = 0; half < 2; ++half) {  // codes 0-15, then 16-31: pairs 8 * half + j
        __m512i words[8];
        TransposeCodeWords(rows, at + kHeader + 16 * half, words);
        for (int j = 0; j < 8; ++j) {
          const __m512 even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(words[j], 24), 24));
          const __m512 odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(words[j], 16), 24));
          _mm512_storeu_si512(out + (8 * half + j) * 16, PairBf16(_mm512_mul_ps(even, d), _mm512_mul_ps(odd, d)));
        }
      }
    } else {
      const __m512 c = std::is_same_v<Fmt, Q4_1>
                           ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header, 16)))
                           : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
      __m512i words[8];
      TransposeCodeWords(rows, at + kHeader, words);
      const __m512i nibble = _mm512_set1_epi32(15);
      // word j = bytes 2j, 2j + 1: their low nibbles are weights 2j, 2j + 1 (pair j), their high ones weights
      // 16 + 2j, 17 + 2j (pair 8 + j)
      for (int j = 0; j < 8; ++j) {
        const __m512i v = words[j];
        const __m512 e0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble));
        const __m512 o0 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), nibble));
        const __m512 e1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4), nibble));
        const __m512 o1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 12));
        _mm512_storeu_si512(out + j * 16, PairBf16(_mm512_fmadd_ps(e0, d, c), _mm512_fmadd_ps(o0, d, c)));
        _mm512_storeu_si512(out + (8 + j) * 16, PairBf16(_mm512_fmadd_ps(e1, d, c), _mm512_fmadd_ps(o1, d, c)));
      }
    }
  }
}

}  // namespace jvllm
#endif
