// Attention inner loops for 1-4 query rows of one KV head (a decode step's grouped query heads): each key and value
// row is loaded once for all the rows, and the rows' sums stay in registers over several keys.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention_vectors.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace jvllm {

// out[i] = the sum of x[i]'s lanes, for 4 vectors.
inline void SumEach4(const VF (&x)[4], float* out) {
#if defined(__AVX512F__)
  __m256 halves[4];  // each vector's two 256-bit halves added, then the AVX2 reduction below
  for (int i = 0; i < 4; ++i) {
    const __m512 v = x[i];
    halves[i] = _mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  const __m256 pairs01 = _mm256_hadd_ps(halves[0], halves[1]);
  const __m256 pairs23 = _mm256_hadd_ps(halves[2], halves[3]);
  const __m256 quads = _mm256_hadd_ps(pairs01, pairs23);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
#elif defined(__AVX__)
  const __m256 pairs01 = _mm256_hadd_ps(x[0], x[1]);     // per 128-bit half: x0 01, x0 23, x1 01, x1 23
  const __m256 pairs23 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 quads = _mm256_hadd_ps(pairs01, pairs23);  // per half: x0 0-3, x1 0-3, x2 0-3, x3 0-3
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
#else
  for (int i = 0; i < 4; ++i) out[i] = Sum(x[i]);
#endif
}

// The sum of x's lanes in SumEach4's order: a key's score is then the same whether it fell in a group of four keys
// or in the remainder, so a query's scores do not depend on how many keys its block holds (a decode row and the same
// query in a verification step with draft tokens after it give the same bits).
inline float SumAsEach4(VF x) {
  const VF four[4] = {x, VF{}, VF{}, VF{}};
  float out[4];
  SumEach4(four, out);
  return out[0];
}

// scores[r * stride + j] = queries[r] . keys[j][offset : offset + hd], rows r < R, keys j in [begin, end). Four keys
// at a time: R x 4 sums, R query vectors and one key vector in registers (16 on AVX2 for R = 3).
template <int R, typename T>
inline void DotKeys(const float* queries, int64_t hd, const T* const* keys, int64_t offset, int64_t begin,
                    int64_t end, float* scores, int64_t stride) {
  constexpr int kKeys = 4;
  int64_t j = begin;
  for (; j + kKeys <= end; j += kKeys) {
    VF acc[R][kKeys] = {};
    for (int64_t c = 0; c < hd; c += kLanes) {
      VF q[R];
      for (int r = 0; r < R; ++r) q[r] = LoadV(queries + r * hd + c);
      for (int t = 0; t < kKeys; ++t) {
        const VF key = LoadV(keys[j + t] + offset + c);
        for (int r = 0; r < R; ++r) acc[r][t] += q[r] * key;
      }
    }
    for (int r = 0; r < R; ++r) SumEach4(acc[r], scores + r * stride + j);
  }
  for (; j < end; ++j) {
    VF acc[R] = {};
    for (int64_t c = 0; c < hd; c += kLanes) {
      const VF key = LoadV(keys[j] + offset + c);
      for (int r = 0; r < R; ++r) acc[r] += LoadV(queries + r * hd + c) * key;
    }
    for (int r = 0; r < R; ++r) scores[r * stride + j] = SumAsEach4(acc[r]);
  }
}

// Rows of probabilities taken together by FewRowValues where that many are left (0: none): on AVX2, 6 rows x 2
// vectors of sums leave registers for the value vectors and one broadcast; the 3 rows x 4 vectors of the smaller
// groups leave none, so there each value vector is read from memory once per row (and two 256-bit loads a cycle
// bound the loop as much as its FMAs). Every sum takes the same FMAs in the same key order either way: the same
// bits.
constexpr int kWideValueRows = kLanes == 8 ? 6 : 0;

// acc[r][c0 : c0 + N * kLanes] += sum_j probs[r * stride + j] * values[j][offset + c0 : ...], keys j in [begin, end):
// R x N sums, R probabilities and one value vector in registers.
template <int R, int N, typename T>
inline void AddValueChunks(const float* probs, int64_t stride, const T* const* values, int64_t offset, int64_t begin,
                           int64_t end, float* acc, int64_t hd, int64_t c0) {
  VF a[R][N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < N; ++c) a[r][c] = LoadV(acc + r * hd + c0 + c * kLanes);
  for (int64_t j = begin; j < end; ++j) {
    if constexpr (R == kWideValueRows) {  // the key's value vectors once, then one row's broadcast at a time
      VF value[N];
      for (int c = 0; c < N; ++c) value[c] = LoadV(values[j] + offset + c0 + c * kLanes);
      for (int r = 0; r < R; ++r) {
        const float p = probs[r * stride + j];
        for (int c = 0; c < N; ++c) a[r][c] += p * value[c];
      }
    } else {
      float p[R];
      for (int r = 0; r < R; ++r) p[r] = probs[r * stride + j];
      for (int c = 0; c < N; ++c) {
        const VF value = LoadV(values[j] + offset + c0 + c * kLanes);
        for (int r = 0; r < R; ++r) a[r][c] += p[r] * value;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < N; ++c) StoreV(acc + r * hd + c0 + c * kLanes, a[r][c]);
}

// acc[r] += sum_j probs[r * stride + j] * values[j][offset : offset + hd], rows r < R, keys j in [begin, end).
template <int R, typename T>
inline void AddValues(const float* probs, int64_t stride, const T* const* values, int64_t offset, int64_t begin,
                      int64_t end, float* acc, int64_t hd) {
  constexpr int kChunks = R == kWideValueRows ? 2 : 4;
  for (int64_t c0 = 0; c0 < hd; c0 += kChunks * kLanes) {
    switch ((hd - c0) / kLanes < kChunks ? (hd - c0) / kLanes : kChunks) {
      case 4: AddValueChunks<R, 4>(probs, stride, values, offset, begin, end, acc, hd, c0); break;
      case 3: AddValueChunks<R, 3>(probs, stride, values, offset, begin, end, acc, hd, c0); break;
      case 2: AddValueChunks<R, 2>(probs, stride, values, offset, begin, end, acc, hd, c0); break;
      default: AddValueChunks<R, 1>(probs, stride, values, offset, begin, end, acc, hd, c0); break;
    }
  }
}

// Calls f(std::integral_constant<int, R>{}, r) for consecutive groups of R rows from row r on, covering `rows`:
// three rows a pass where they fit AVX2's registers, two where four (or two) are left.
template <typename F>
inline void InRowGroups(int64_t rows, F&& f) {
  for (int64_t r = 0; r < rows;) {
    const int64_t left = rows - r;
    if (left == 4 || left == 2) {
      f(std::integral_constant<int, 2>{}, r);
      r += 2;
    } else if (left >= 3) {
      f(std::integral_constant<int, 3>{}, r);
      r += 3;
    } else {
      f(std::integral_constant<int, 1>{}, r);
      r += 1;
    }
  }
}

// DotKeys for any number of rows.
template <typename T>
inline void FewRowDots(int64_t rows, const float* queries, int64_t hd, const T* const* keys, int64_t offset,
                       int64_t begin, int64_t end, float* scores, int64_t stride) {
  if (begin >= end) return;
  InRowGroups(rows, [&](auto group, int64_t r) {
    DotKeys<decltype(group)::value>(queries + r * hd, hd, keys, offset, begin, end, scores + r * stride, stride);
  });
}

// AddValues for any number of rows.
template <typename T>
inline void FewRowValues(int64_t rows, const float* probs, int64_t stride, const T* const* values, int64_t offset,
                         int64_t begin, int64_t end, float* acc, int64_t hd) {
  if (begin >= end) return;
  int64_t wide = 0;
  if constexpr (kWideValueRows > 0) {
    for (; wide + kWideValueRows <= rows; wide += kWideValueRows) {
      AddValues<kWideValueRows>(probs + wide * stride, stride, values, offset, begin, end, acc + wide * hd, hd);
    }
  }
  InRowGroups(rows - wide, [&](auto group, int64_t r) {
    const int64_t at = wide + r;
    AddValues<decltype(group)::value>(probs + at * stride, stride, values, offset, begin, end, acc + at * hd, hd);
  });
}

}  // namespace jvllm
