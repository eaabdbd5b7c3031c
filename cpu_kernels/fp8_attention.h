// Few-query attention over 8-bit (e5m2) pages with AVX-512 BF16 dot products, the pages' bytes widened in registers.
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

// 32 e5m2 values -> 32 bfloat16 lanes holding each value times 2^-112.
inline __m512i E5m2AsScaledBf16(const E5m2* p) {
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

// scores[r * stride + j] = q[r] . keys[j][offset : offset + hd] for rows r < R, keys j in [begin, end); q [R, hd]
// the scaled queries (ScaledToBf16). Four keys at a time, R x 4 sums in registers.
template <int R>
inline void E5m2DotKeys(const uint16_t* q, int64_t hd, const E5m2* const* keys, int64_t offset, int64_t begin,
                        int64_t end, float* scores, int64_t stride) {
  constexpr int kKeys = 4;
  int64_t j = begin;
  for (; j + kKeys <= end; j += kKeys) {
    VF acc[R][kKeys] = {};
    for (int64_t c = 0; c < hd; c += kBf16Chunk) {
      __m512i key[kKeys];
      for (int t = 0; t < kKeys; ++t) key[t] = E5m2AsScaledBf16(keys[j + t] + offset + c);
      for (int r = 0; r < R; ++r) {
        const __m512i query = _mm512_loadu_si512(q + r * hd + c);
        for (int t = 0; t < kKeys; ++t) acc[r][t] = DotPairs(acc[r][t], query, key[t]);
      }
    }
    for (int r = 0; r < R; ++r) SumEach4(acc[r], scores + r * stride + j);
  }
  for (; j < end; ++j) {
    VF acc[R] = {};
    for (int64_t c = 0; c < hd; c += kBf16Chunk) {
      const __m512i key = E5m2AsScaledBf16(keys[j] + offset + c);
      for (int r = 0; r < R; ++r) acc[r] = DotPairs(acc[r], _mm512_loadu_si512(q + r * hd + c), key);
    }
    for (int r = 0; r < R; ++r) scores[r * stride + j] = SumAsEach4(acc[r]);
  }
}

// acc[r][c0 : c0 + N * 32] += sum_j p[r][j] * values[j][offset + c0 : ...] for keys j in [begin, end), two keys a
// step: their rows interleaved into pairs (bf16_attention.h's pair order), times the pair of each row's scaled
// probabilities (p [R rows of `stride`], ScaledToBf16). N x 2 x R sums in registers.
template <int R, int N>
inline void E5m2AddValueChunks(const uint16_t* p, int64_t stride, const E5m2* const* values, int64_t offset,
                               int64_t begin, int64_t end, float* acc, int64_t hd, int64_t c0) {
  __m512 lo[R][N], hi[R][N];
  LoadInPairOrder(acc, hd, c0, lo, hi);
  for (int64_t j = begin; j < end; j += 2) {
    const bool lone = j + 1 == end;  // an odd count: the last key pairs with itself at probability 0
    const E5m2* first = values[j] + offset + c0;
    const E5m2* second = lone ? first : values[j + 1] + offset + c0;
    __m512i pair[R];
    for (int r = 0; r < R; ++r) {
      uint32_t both = p[r * stride + j];
      if (!lone) both |= static_cast<uint32_t>(p[r * stride + j + 1]) << 16;
      pair[r] = _mm512_set1_epi32(static_cast<int32_t>(both));
    }
    for (int c = 0; c < N; ++c) {
      const __m512i a = E5m2AsScaledBf16(first + c * kBf16Chunk), b = E5m2AsScaledBf16(second + c * kBf16Chunk);
      const __m512i low = _mm512_unpacklo_epi16(a, b), high = _mm512_unpackhi_epi16(a, b);
      for (int r = 0; r < R; ++r) {
        lo[r][c] = DotPairs(lo[r][c], pair[r], low);
        hi[r][c] = DotPairs(hi[r][c], pair[r], high);
      }
    }
  }
  StoreFromPairOrder(lo, hi, acc, hd, c0);
}

// E5m2DotKeys for any number of rows.
inline void E5m2FewRowDots(int64_t rows, const uint16_t* q, int64_t hd, const E5m2* const* keys, int64_t offset,
                           int64_t begin, int64_t end, float* scores, int64_t stride) {
  if (begin >= end) return;
  InRowGroups(rows, [&](auto group, int64_t r) {
    E5m2DotKeys<decltype(group)::value>(q + r * hd, hd, keys, offset, begin, end, scores + r * stride, stride);
  });
}

// E5m2AddValueChunks over the whole head (64 dims a pass) for any number of rows.
inline void E5m2FewRowValues(int64_t rows, const uint16_t* p, int64_t stride, const E5m2* const* values,
                             int64_t offset, int64_t begin, int64_t end, float* acc, int64_t hd) {
  if (begin >= end) return;
  InRowGroups(rows, [&](auto group, int64_t r) {
    constexpr int R = decltype(group)::value;
    int64_t c0 = 0;
    for (; c0 + 2 * kBf16Chunk <= hd; c0 += 2 * kBf16Chunk)
      E5m2AddValueChunks<R, 2>(p + r * stride, stride, values, offset, begin, end, acc + r * hd, hd, c0);
    if (c0 < hd) E5m2AddValueChunks<R, 1>(p + r * stride, stride, values, offset, begin, end, acc + r * hd, hd, c0);
  });
}
#else
inline void ScaledToBf16(const float*, int64_t, uint16_t*) {}
inline void E5m2FewRowDots(int64_t, const uint16_t*, int64_t, const E5m2* const*, int64_t, int64_t, int64_t, float*,
                           int64_t) {}
inline void E5m2FewRowValues(int64_t, const uint16_t*, int64_t, const E5m2* const*, int64_t, int64_t, int64_t,
                             float*, int64_t) {}
#endif

}  // namespace jvllm
