// The prefill attention's two products on the AMX tile unit (bf16_prefill_attention.h keeps the layouts): a block's
// scores transposed, scores_t [key, row] = keys [key, hd] times the query pairs [hd / 2, row] (keys as the A operand
// as they lie, the query pairs as the B operand as they lie), and the outputs transposed, out_t [dim, row] += values
// transposed into pairs [dim, key / 2] (the A operand) times the probability pairs [key / 2, row] (the B operand).
// Both are the vector path's sums of bf16 products in float32, in the tile unit's order; the online softmax between
// them stays on the vectors.
#pragma once

#include "amx_tiles.h"

#if JVLLM_AMX
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "transpose.h"

namespace jvllm {

constexpr int64_t kAmxKeys = 32;  // keys per step of the products: two tiles of scores, one A tile of value pairs

// key_rows [keys_p, hd] = the rows keys[j] (bf16, hd values each) for j < keys_p: the A operand's rows in one run.
inline void GatherKeyRows(const uint16_t* const* keys, int64_t keys_p, int64_t hd, uint16_t* key_rows) {
  for (int64_t j = 0; j < keys_p; ++j) std::memcpy(key_rows + j * hd, keys[j], hd * sizeof(uint16_t));
}

// Tiles of sums 2t + c (t: A tile, c: B tile) at `at`, rows `row_floats` apart, tile 2t + c at row block t and
// column block c: (with `add`, what is there plus) two A tiles [16 rows] times one or two (`two`) B tiles [16 columns]
// over `steps` depth steps of 16 pairs. A tile t's rows start at a + t * a_next bytes, a_row bytes apart; B tile c's
// at b + c * 64 bytes, b_row bytes apart; each depth step moves A by a_step and B by b_step bytes. Tiles 0-3: sums,
// 4-5 A, 6-7 B.
inline void AmxTwoByTwo(const void* a, int64_t a_next, int64_t a_row, int64_t a_step, const void* b, int64_t b_row,
                        int64_t b_step, int64_t steps, bool two, bool add, float* at, int64_t row_floats) {
  const int64_t row_bytes = row_floats * 4;
  float* const below = at + 16 * row_floats;
  if (add) {
    _tile_loadd(0, at, row_bytes);
    _tile_loadd(2, below, row_bytes);
    if (two) {
      _tile_loadd(1, at + 16, row_bytes);
      _tile_loadd(3, below + 16, row_bytes);
    }
  } else {
    _tile_zero(0);
    _tile_zero(2);
    _tile_zero(1);
    _tile_zero(3);
  }
  const char* a_at = static_cast<const char*>(a);
  const char* b_at = static_cast<const char*>(b);
  for (int64_t i = 0; i < steps; ++i, a_at += a_step, b_at += b_step) {
    _tile_loadd(4, a_at, a_row);
    _tile_loadd(5, a_at + a_next, a_row);
    _tile_loadd(6, b_at, b_row);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, b_at + 64, b_row);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, at, row_bytes);
  _tile_stored(2, below, row_bytes);
  if (two) {
    _tile_stored(1, at + 16, row_bytes);
    _tile_stored(3, below + 16, row_bytes);
  }
}

// scores_t[j, r] = key_rows[j] . (query r), for keys j < keys_p (a multiple of 32) and the rows of chunks
// [first_chunk(j0), chunks) of 16 (the chunks before it, whose rows all precede keys j0.., are left as they were).
// query_pairs [hd / 2, rows_p] as bf16 pairs; hd a multiple of 32. Tiles 0-3: sums (key tile t, chunk c: 2t + c),
// 4-5 keys, 6-7 queries.
template <typename FirstChunk>
inline void AmxKeyScores(const uint16_t* key_rows, int64_t keys_p, const uint32_t* query_pairs, int64_t rows_p,
                         int64_t hd, const FirstChunk& first_chunk, float* scores_t) {
  const int64_t chunks = rows_p / 16;
  for (int64_t j0 = 0; j0 < keys_p; j0 += kAmxKeys) {
    for (int64_t c = first_chunk(j0); c < chunks; c += 2) {
      AmxTwoByTwo(key_rows + j0 * hd, 16 * hd * 2, hd * 2, 64, query_pairs + c * 16, rows_p * 4, 16 * rows_p * 4,
                  hd / 32, c + 1 < chunks, false, scores_t + j0 * rows_p + c * 16, rows_p);
    }
  }
}

// value_pairs_t [hd, pairs_p] = value_pairs [pairs_p, hd] transposed (32-bit pairs; pairs_p and hd multiples of 16).
inline void TransposeValuePairs(const uint32_t* value_pairs, int64_t pairs_p, int64_t hd, uint32_t* value_pairs_t) {
  for (int64_t p = 0; p < pairs_p; p += 16) {
    for (int64_t d = 0; d < hd; d += 16) {
      Transpose16(value_pairs + p * hd + d, hd, value_pairs_t + d * pairs_p + p, pairs_p);
    }
  }
}

// out_t [hd, rows_p] = out_t * rescale (per row) + value_pairs_t [hd, pairs_p] times prob_pairs [pairs_p, rows_p],
// chunk c of 16 rows taking the first seen_pairs(c) pairs rounded up to 16 (the rest are 0 for its rows). hd a multiple
// of 32. Tiles 0-3: sums (dim tile t, chunk c: 2t + c), 4-5 values, 6-7 probabilities.
template <typename SeenPairs>
inline void AmxAddValues(const uint32_t* value_pairs_t, int64_t pairs_p, const uint32_t* prob_pairs,
                         const float* rescale, int64_t rows_p, int64_t hd, const SeenPairs& seen_pairs, float* out_t) {
  const int64_t chunks = rows_p / 16;
  const __m512 ones = _mm512_set1_ps(1.0f);
  for (int64_t c = 0; c < chunks; ++c) {  // the old sums scaled in place, where the running max moved
    const __m512 scale = _mm512_loadu_ps(rescale + c * 16);
    if (_mm512_cmpneq_ps_mask(scale, ones) == 0) continue;
    for (int64_t d = 0; d < hd; ++d) {
      float* at = out_t + d * rows_p + c * 16;
      _mm512_storeu_ps(at, _mm512_mul_ps(_mm512_loadu_ps(at), scale));
    }
  }
  for (int64_t c = 0; c < chunks; c += 2) {
    const bool two = c + 1 < chunks;
    const int64_t pairs = std::min<int64_t>(pairs_p, (seen_pairs(two ? c + 1 : c) + 15) / 16 * 16);
    if (pairs == 0) continue;
    for (int64_t d0 = 0; d0 < hd; d0 += 32) {
      AmxTwoByTwo(value_pairs_t + d0 * pairs_p, 16 * pairs_p * 4, pairs_p * 4, 64, prob_pairs + c * 16, rows_p * 4,
                  16 * rows_p * 4, pairs / 16, two, true, out_t + d0 * rows_p + c * 16, rows_p);
    }
  }
}

}  // namespace jvllm
#endif  // JVLLM_AMX
