// Decode attention over bfloat16 pages with AVX-512 BF16 dot products (`vdpbf16ps`: 32 bf16 products summed into 16
// floats per instruction): a query row's scores against keys read in place, and probabilities times value rows.
// Queries and probabilities are split into a bfloat16 high part and the bfloat16 rest (two products each), so the
// sums keep ~16 bits of them rather than bfloat16's 8: the scores and outputs stay within float32 rounding of the
// float loops' (the pages' values are bf16 already). Without AVX-512 BF16 (kBf16Attention false) the float loops of
// few_row_attention.h run instead.
#pragma once

#include <array>
#include <cstdint>

#include "few_row_attention.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace jvllm {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Attention = true;
constexpr int64_t kBf16Chunk = 32;  // bf16 values per 512-bit vector: head_dim must be a multiple of it

// hi[i] = bf16(x[i]), lo[i] = bf16(x[i] - hi[i]), n a multiple of 16.
inline void SplitToBf16(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m512 back = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
    const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), reinterpret_cast<const __m256i&>(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), reinterpret_cast<const __m256i&>(l));
  }
}

inline __m512 DotPairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(a), reinterpret_cast<const __m512bh&>(b));
}

// 32 bf16 lanes of a page row, for the products below: bfloat16 pages as stored (8-bit pages: fp8_attention.h).
inline __m512i RowChunk(const uint16_t* p) { return _mm512_loadu_si512(p); }

// A row's `Parts` bf16 parts (1: hi alone; 2: hi and lo) at index `at`, 32 lanes each.
template <int Parts>
inline std::array<__m512i, Parts> LoadParts(const uint16_t* hi, const uint16_t* lo, int64_t at) {
  if constexpr (Parts == 2) {
    return {_mm512_loadu_si512(hi + at), _mm512_loadu_si512(lo + at)};
  } else {
    return {_mm512_loadu_si512(hi + at)};
  }
}

// acc + the bf16 pair products of each part with b, part after part.
template <size_t Parts>
inline __m512 DotParts(__m512 acc, const std::array<__m512i, Parts>& parts, __m512i b) {
  for (size_t i = 0; i < Parts; ++i) acc = DotPairs(acc, parts[i], b);
  return acc;
}

// scores[r * stride + j] = q[r] . keys[j][offset : offset + hd] for rows r < R, keys j in [begin, end); q in
// `Parts` bf16 parts (q_hi, and q_lo where Parts is 2: [R, hd] each), key rows of RowT read through RowChunk. Four
// keys at a time, R x 4 sums in registers.
template <int R, int Parts, typename RowT>
inline void Bf16DotKeys(const uint16_t* q_hi, const uint16_t* q_lo, int64_t hd, const RowT* const* keys,
                        int64_t offset, int64_t begin, int64_t end, float* scores, int64_t stride) {
  constexpr int kKeys = 4;
  int64_t j = begin;
  for (; j + kKeys <= end; j += kKeys) {
    VF acc[R][kKeys] = {};
    for (int64_t c = 0; c < hd; c += kBf16Chunk) {
      __m512i key[kKeys];
      for (int t = 0; t < kKeys; ++t) key[t] = RowChunk(keys[j + t] + offset + c);
      for (int r = 0; r < R; ++r) {
        const auto query = LoadParts<Parts>(q_hi, q_lo, r * hd + c);
        for (int t = 0; t < kKeys; ++t) acc[r][t] = DotParts(acc[r][t], query, key[t]);
      }
    }
    for (int r = 0; r < R; ++r) SumEach4(acc[r], scores + r * stride + j);
  }
  for (; j < end; ++j) {
    VF acc[R] = {};
    for (int64_t c = 0; c < hd; c += kBf16Chunk) {
      const __m512i key = RowChunk(keys[j] + offset + c);
      for (int r = 0; r < R; ++r) acc[r] = DotParts(acc[r], LoadParts<Parts>(q_hi, q_lo, r * hd + c), key);
    }
    for (int r = 0; r < R; ++r) scores[r * stride + j] = SumAsEach4(acc[r]);
  }
}

// The value pairs below hold, per 128-bit lane i, dims 8i..8i+3 (`unpacklo`) or 8i+4..8i+7 (`unpackhi`) of a 32-dim
// chunk. These turn two natural 16-float halves of a chunk into those orders and back.
inline void ToPairOrder(__m512 n0, __m512 n1, __m512* lo, __m512* hi) {
  const __m512i lo_index = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi_index = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  *lo = _mm512_permutex2var_ps(n0, lo_index, n1);
  *hi = _mm512_permutex2var_ps(n0, hi_index, n1);
}

inline void FromPairOrder(__m512 lo, __m512 hi, __m512* n0, __m512* n1) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  *n0 = _mm512_permutex2var_ps(lo, first, hi);
  *n1 = _mm512_permutex2var_ps(lo, second, hi);
}

// acc[r][c0 : c0 + N * 32] of rows r < R (rows hd apart) in pair order: lo[r][c], hi[r][c] for chunk c.
template <int R, int N>
inline void LoadInPairOrder(const float* acc, int64_t hd, int64_t c0, __m512 (&lo)[R][N],
                            __m512 (&hi)[R][N]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < N; ++c) {
      const float* a = acc + r * hd + c0 + c * kBf16Chunk;
      ToPairOrder(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16), &lo[r][c], &hi[r][c]);
    }
}

// LoadInPairOrder's inverse: the pairs' sums back into acc in natural order.
template <int R, int N>
inline void StoreFromPairOrder(const __m512 (&lo)[R][N], const __m512 (&hi)[R][N], float* acc, int64_t hd,
                               int64_t c0) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < N; ++c) {
      __m512 n0, n1;
      FromPairOrder(lo[r][c], hi[r][c], &n0, &n1);
      float* a = acc + r * hd + c0 + c * kBf16Chunk;
      _mm512_storeu_ps(a, n0);
      _mm512_storeu_ps(a + 16, n1);
    }
}

// acc[r][c0 : c0 + N * 32] += sum_j p[r][j] * values[j][offset + c0 : ...] for keys j in [begin, end), two keys a
// step: their rows (of RowT, read through RowChunk) interleaved into (v_j, v_j+1) pairs, times the pair (p_j, p_j+1)
// of each of the rows' `Parts` bf16 parts (p_hi, and p_lo where Parts is 2: [R rows of `stride`], indexed by j).
// N x 2 x R sums in registers.
template <int R, int N, int Parts, typename RowT>
inline void Bf16AddValueChunks(const uint16_t* p_hi, const uint16_t* p_lo, int64_t stride, const RowT* const* values,
                               int64_t offset, int64_t begin, int64_t end, float* acc, int64_t hd, int64_t c0) {
  const uint16_t* parts[2] = {p_hi, p_lo};
  __m512 lo[R][N], hi[R][N];
  LoadInPairOrder(acc, hd, c0, lo, hi);
  for (int64_t j = begin; j < end; j += 2) {
    const bool lone = j + 1 == end;  // an odd count: the last key pairs with itself at probability 0
    const RowT* first = values[j] + offset + c0;
    const RowT* second = lone ? first : values[j + 1] + offset + c0;
    std::array<__m512i, Parts> pairs[R];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < Parts; ++i) {
        uint32_t both = parts[i][r * stride + j];
        if (!lone) both |= static_cast<uint32_t>(parts[i][r * stride + j + 1]) << 16;
        pairs[r][i] = _mm512_set1_epi32(static_cast<int32_t>(both));
      }
    }
    for (int c = 0; c < N; ++c) {
      const __m512i a = RowChunk(first + c * kBf16Chunk), b = RowChunk(second + c * kBf16Chunk);
      const __m512i low = _mm512_unpacklo_epi16(a, b), high = _mm512_unpackhi_epi16(a, b);
      for (int r = 0; r < R; ++r) {
        lo[r][c] = DotParts(lo[r][c], pairs[r], low);
        hi[r][c] = DotParts(hi[r][c], pairs[r], high);
      }
    }
  }
  StoreFromPairOrder(lo, hi, acc, hd, c0);
}

// Bf16AddValueChunks over the whole head, 64 dims a pass.
template <int R, int Parts, typename RowT>
inline void Bf16AddValues(const uint16_t* p_hi, const uint16_t* p_lo, int64_t stride, const RowT* const* values,
                          int64_t offset, int64_t begin, int64_t end, float* acc, int64_t hd) {
  int64_t c0 = 0;
  for (; c0 + 2 * kBf16Chunk <= hd; c0 += 2 * kBf16Chunk)
    Bf16AddValueChunks<R, 2, Parts>(p_hi, p_lo, stride, values, offset, begin, end, acc, hd, c0);
  if (c0 < hd) Bf16AddValueChunks<R, 1, Parts>(p_hi, p_lo, stride, values, offset, begin, end, acc, hd, c0);
}

// Bf16DotKeys for any number of rows (`Parts` bf16 parts of the queries: 2 over bfloat16 pages, 1 over 8-bit ones).
template <int Parts = 2, typename RowT>
inline void Bf16FewRowDots(int64_t rows, const uint16_t* q_hi, const uint16_t* q_lo, int64_t hd,
                           const RowT* const* keys, int64_t offset, int64_t begin, int64_t end, float* scores,
                           int64_t stride) {
  if (begin >= end) return;
  InRowGroups(rows, [&](auto group, int64_t r) {
    Bf16DotKeys<decltype(group)::value, Parts>(q_hi + r * hd, Parts == 2 ? q_lo + r * hd : nullptr, hd, keys, offset,
                                               begin, end, scores + r * stride, stride);
  });
}

// Bf16AddValues for any number of rows.
template <int Parts = 2, typename RowT>
inline void Bf16FewRowValues(int64_t rows, const uint16_t* p_hi, const uint16_t* p_lo, int64_t stride,
                             const RowT* const* values, int64_t offset, int64_t begin, int64_t end, float* acc,
                             int64_t hd) {
  if (begin >= end) return;
  InRowGroups(rows, [&](auto group, int64_t r) {
    Bf16AddValues<decltype(group)::value, Parts>(p_hi + r * stride, Parts == 2 ? p_lo + r * stride : nullptr,
                                                 stride, values, offset, begin, end, acc + r * hd, hd);
  });
}
#else
constexpr bool kBf16Attention = false;
constexpr int64_t kBf16Chunk = 32;
inline void SplitToBf16(const float*, int64_t, uint16_t*, uint16_t*) {}
template <int Parts = 2, typename RowT>
inline void Bf16FewRowDots(int64_t, const uint16_t*, const uint16_t*, int64_t, const RowT* const*, int64_t, int64_t,
                           int64_t, float*, int64_t) {}
template <int Parts = 2, typename RowT>
inline void Bf16FewRowValues(int64_t, const uint16_t*, const uint16_t*, int64_t, const RowT* const*, int64_t,
                             int64_t, int64_t, float*, int64_t) {}
#endif

}  // namespace jvllm
