// The few-query attention's products over bf16 pages on the AMX tile unit (direct_attention.h: decode rows
// and rows verifying draft tokens). Per KV head and block of keys, in groups of 16 keys (one page's run of token rows
// where the pages hold them so, read in place as a tile):
// * scores: the keys [16, hd] are the A operand as they lie; the B operand holds up to 8 query rows as columns, each
//   row's bf16 high part in column c and its low part in column 8 + c (bf16_attention.h's split, which keeps ~16 bits
//   of the queries); the sums [key, column] are transposed and each row's two columns added;
// * values: the value rows [16 keys, 32 dims] are the B operand as they lie, which pairs dims, not keys; so the
//   probabilities go in twice, as (p, 0) and (0, p) pairs per key (the A operand, high parts in rows 0-7, low parts
//   in 8-15), giving the even and the odd dims of the sums, interleaved when they are added to the outputs.
// Each output is then a fixed sequence of float32 operations on its own row's inputs, whatever rows come with it, so
// a decode row and the same query in a verification step give the same bits.
#pragma once

#include "amx_tiles.h"

#if JVLLM_AMX
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "line_aligned.h"
#include "transpose.h"

namespace jvllm {

constexpr int64_t kAmxQueryRows = 8;  // query rows per pass: high parts in tile columns (or rows) 0-7, low in 8-15
constexpr int64_t kAmxGroupKeys = 16;
constexpr int64_t kAmxBlockGroups = 4;  // groups of 16 keys in a block of the direct path (kBlockKeys = 64)

// Per-thread buffers of the AMX direct path (64-byte lines: tile rows must not straddle two).
struct AmxDirectScratch {
  LineAlignedVector<uint32_t> query_cols;   // [heads, row passes, hd / 2, 16] B operands of the scores
  // [4, 16, hd / 2]: query rows before their transpose; a block's key or value rows that are not in place
  LineAlignedVector<uint32_t> staged_rows;
  LineAlignedVector<float> sums;            // [4, 16, 16] tiles of sums
  LineAlignedVector<uint32_t> prob_pairs;   // [4 groups, 2 (even, odd), 16, 16] A operands of the values

  void Reserve(int64_t heads, int64_t rows, int64_t hd) {
    const auto cols = static_cast<size_t>(heads * ((rows + kAmxQueryRows - 1) / kAmxQueryRows) * hd / 2 * 16);
    if (query_cols.size() < cols) query_cols.resize(cols);
    if (staged_rows.size() < static_cast<size_t>(kAmxBlockGroups * 16 * hd / 2)) {
      staged_rows.resize(kAmxBlockGroups * 16 * hd / 2);
    }
    sums.resize(kAmxBlockGroups * 256);
    prob_pairs.resize(kAmxBlockGroups * 2 * 256);
  }
};

// cols [hd / 2, 16] = the bf16 pairs of rows r < n (<= 8) of q_hi (column r) and q_lo (column 8 + r), [n, hd] each;
// other columns 0.
inline void PackQueryColumns(const uint16_t* q_hi, const uint16_t* q_lo, int64_t n, int64_t hd, AmxDirectScratch& s,
                             uint32_t* cols) {
  uint32_t* staged = s.staged_rows.data();  // [16, hd / 2]
  std::memset(staged, 0, 16 * hd * 2);
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(staged + r * hd / 2, q_hi + r * hd, hd * 2);
    std::memcpy(staged + (kAmxQueryRows + r) * hd / 2, q_lo + r * hd, hd * 2);
  }
  for (int64_t p = 0; p < hd / 2; p += 16) Transpose16(staged + p, hd / 2, cols + p * 16, 16);
}

// Rows j0 .. j0 + 15 of one KV head (rows[j] + offset, hd bf16 values each) as a tile operand: the pages in place
// where the rows lie one token stride apart (*row_bytes: that stride), else copied to `staged` [16, hd] with rows
// from `valid` on zero (*row_bytes: 2 hd).
inline const uint16_t* GroupRows(const uint16_t* const* rows, int64_t offset, int64_t j0, int64_t valid,
                                 int64_t token_stride, int64_t hd, uint16_t* staged, int64_t* row_bytes) {
  const uint16_t* first = rows[j0] + offset;
  bool in_place = valid >= kAmxGroupKeys;
  for (int64_t j = 1; j < kAmxGroupKeys && in_place; ++j) in_place = rows[j0 + j] + offset == first + j * token_stride;
  if (in_place) {
    *row_bytes = token_stride * 2;
    return first;
  }
  for (int64_t j = 0; j < kAmxGroupKeys; ++j) {
    if (j < valid) {
      std::memcpy(staged + j * hd, rows[j0 + j] + offset, hd * 2);
    } else {
      std::memset(staged + j * hd, 0, hd * 2);
    }
  }
  *row_bytes = hd * 2;
  return staged;
}

// scores[r * stride + j] = (q_hi + q_lo)[r] . key j for rows r < n of cols (PackQueryColumns) and the block's keys
// j < 16 groups (groups <= 4; group g's rows at keys[g], rows key_bytes[g] apart). Tiles 0-3: sums, 4-5 keys, 6
// queries.
template <typename AfterGroup>
inline void AmxBlockScores(int64_t groups, const uint16_t* const* keys, const int64_t* key_bytes, int64_t hd,
                           const uint32_t* cols, int64_t n, AmxDirectScratch& s, float* scores, int64_t stride,
                           const AfterGroup& after_group) {
  float* sums = s.sums.data();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t d = 0; d < hd; d += 32) {
    _tile_loadd(6, cols + d / 2 * 16, 64);
    _tile_loadd(4, keys[0] + d, key_bytes[0]);
    _tile_dpbf16ps(0, 4, 6);
    if (groups > 1) {
      _tile_loadd(5, keys[1] + d, key_bytes[1]);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (groups > 2) {
      _tile_loadd(4, keys[2] + d, key_bytes[2]);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (groups > 3) {
      _tile_loadd(5, keys[3] + d, key_bytes[3]);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  _tile_stored(0, sums, 64);
  if (groups > 1) _tile_stored(1, sums + 256, 64);
  if (groups > 2) _tile_stored(2, sums + 512, 64);
  if (groups > 3) _tile_stored(3, sums + 768, 64);
  alignas(64) float columns[256];  // [column, key]
  for (int64_t g = 0; g < groups; ++g) {
    Transpose16(sums + g * 256, 16, columns, 16);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 score = _mm512_add_ps(_mm512_load_ps(columns + r * 16),
                                         _mm512_load_ps(columns + (kAmxQueryRows + r) * 16));
      _mm512_storeu_ps(scores + r * stride + g * kAmxGroupKeys, score);
    }
    after_group(g);
  }
}

// acc[r] = acc[r] * rescale[r] + sum_j (p_hi + p_lo)[r][j] values[j] for rows r < n (acc [n, hd]; p_hi / p_lo rows
// p_stride apart) over the block's keys j < 16 groups (group g's value rows at values[g], value_bytes[g] apart). Tiles
// 0-3: sums (even and odd dims of two 32-dim slices), 4-5 probabilities, 6-7 values.
template <typename AfterGroup>
inline void AmxBlockValues(int64_t groups, const uint16_t* const* values, const int64_t* value_bytes, int64_t hd,
                           const uint16_t* p_hi, const uint16_t* p_lo, int64_t p_stride, int64_t n,
                           const float* rescale, AmxDirectScratch& s, float* acc, const AfterGroup& after_group) {
  uint32_t* pairs = s.prob_pairs.data();  // [group, even / odd, 16 rows, 16 keys]
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t* even = pairs + g * 512;
    for (int64_t r = 0; r < kAmxQueryRows; ++r) {
      for (int64_t part = 0; part < 2; ++part) {
        const int64_t row = part * kAmxQueryRows + r;
        __m512i p = zero;
        if (r < n) {
          const uint16_t* src = (part == 0 ? p_hi : p_lo) + r * p_stride + g * kAmxGroupKeys;
          p = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        }
        _mm512_store_si512(even + row * 16, p);
        _mm512_store_si512(even + 256 + row * 16, _mm512_slli_epi32(p, 16));
      }
    }
  }
  float* sums = s.sums.data();  // [4, 16, 16]: even and odd dims of slice 0, then of slice 1
  const __m512i first_half = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    const bool two = d0 + 32 < hd;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t g = 0; g < groups; ++g) {
      _tile_loadd(4, pairs + g * 512, 64);
      _tile_loadd(5, pairs + g * 512 + 256, 64);
      _tile_loadd(6, values[g] + d0, value_bytes[g]);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, values[g] + d0 + 32, value_bytes[g]);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
      if (d0 == 0) after_group(g);
    }
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + 256, 64);
    if (two) {
      _tile_stored(2, sums + 512, 64);
      _tile_stored(3, sums + 768, 64);
    }
    for (int64_t r = 0; r < n; ++r) {
      const __m512 scale = _mm512_set1_ps(rescale[r]);
      for (int64_t slice = 0; slice < (two ? 2 : 1); ++slice) {
        const float* at = sums + slice * 512;
        const __m512 even = _mm512_add_ps(_mm512_load_ps(at + r * 16), _mm512_load_ps(at + (kAmxQueryRows + r) * 16));
        const __m512 odd = _mm512_add_ps(_mm512_load_ps(at + 256 + r * 16),
                                         _mm512_load_ps(at + 256 + (kAmxQueryRows + r) * 16));
        float* out = acc + r * hd + d0 + slice * 32;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), scale,
                                              _mm512_permutex2var_ps(even, first_half, odd)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_loadu_ps(out + 16), scale,
                                                   _mm512_permutex2var_ps(even, second_half, odd)));
      }
    }
  }
}

}  // namespace jvllm
#endif  // JVLLM_AMX
