// Prefill attention over bfloat16 pages with AVX-512 BF16 dot products (`vdpbf16ps`): one work item's query rows
// (its queries x the query heads of one KV head) against blocks of keys. Scores are kept transposed, [key, row], so
// that each key's pair of bf16 values is one broadcast against 16 rows of query pairs, and the online softmax runs
// down the rows in vectors with no horizontal sums; the output is kept transposed too, [dim, row], for the same reason
// with the values. Queries and probabilities are rounded to bfloat16 once (the pages hold bf16 keys and values
// already), as the batched products round their inputs: the sums are float32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx_prefill_attention.h"
#include "bf16_attention.h"
#include "line_aligned.h"
#include "transpose.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JVLLM_BF16_PREFILL 1
#else
#define JVLLM_BF16_PREFILL 0
#endif

namespace jvllm {

constexpr int64_t kTileRows = 16;      // rows per vector of the transposed tiles
constexpr int64_t kMaxBlockKeys = 64;  // keys per block at most
constexpr float kNoScore = -1e30f;     // the running max before any key: finite, so that exp(it - it) is 1

#if JVLLM_BF16_PREFILL
constexpr bool kBf16Prefill = true;

// One KV head's running state over the blocks of keys: rows_p = rows rounded up to 16.
struct PrefillHead {
  uint32_t* query_pairs;  // [hd / 2, rows_p] bf16 pairs (q[r][2d], q[r][2d + 1]) of the scaled queries
  float* out_t;           // [hd, rows_p] unnormalised outputs
  float* row_max;         // [rows_p]
  float* denom;           // [rows_p]
};

// Per-thread scratch of one item: every head's state, and one block's tiles (on cache lines, for AMX's tile loads).
struct PrefillScratch {
  LineAlignedVector<uint32_t> query_pairs, prob_pairs, value_pairs;
  LineAlignedVector<float> out_t, scores_t;
  std::vector<float> row_max, denom, rescale;
  LineAlignedVector<uint16_t> key_rows;       // AMX: [block, hd] the block's keys one after another
  LineAlignedVector<uint32_t> value_pairs_t;  // AMX: [hd, block / 2] value_pairs transposed
  std::vector<int32_t> row_pos;
  std::vector<uint16_t> converted;  // [max(2 * block, rows_p), hd] this step's own keys and values rounded to bf16
  std::vector<uint16_t> zero_row;   // [hd] of 0: the rows past a block's keys

  void Reserve(int64_t heads, int64_t rows_p, int64_t hd, int64_t block) {
    auto grow = [](auto& v, size_t n) { if (v.size() < n) v.resize(n); };
    grow(query_pairs, heads * hd / 2 * rows_p);
    grow(out_t, heads * hd * rows_p);
    grow(row_max, heads * rows_p);
    grow(denom, heads * rows_p);
    grow(scores_t, block * rows_p);
    grow(prob_pairs, block / 2 * rows_p);
    grow(value_pairs, block / 2 * hd);
    grow(key_rows, block * hd);
    grow(value_pairs_t, block / 2 * hd);
    grow(rescale, rows_p);
    grow(row_pos, rows_p);
    grow(converted, std::max(2 * block, rows_p) * hd);
    grow(zero_row, hd);
  }

  PrefillHead Head(int64_t h, int64_t rows_p, int64_t hd) {
    return {query_pairs.data() + h * hd / 2 * rows_p, out_t.data() + h * hd * rows_p, row_max.data() + h * rows_p,
            denom.data() + h * rows_p};
  }
};

inline __m512i BroadcastPair(const void* p) {  // the 32 bits at p (two bf16 values) in every lane
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

// exp(x) for x <= 0 (scores less their running max), to ~3e-6 relative: 2^n 2^f with n = round(x log2 e) and a
// degree-5 polynomial of 2^f on [-1/2, 1/2]; scalef takes 2^n to 0 below the float range. Finer than the bfloat16
// the probabilities are rounded to, and cheaper than VecExp (no clamps, no integer conversions).
inline __m512 ExpNonPositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// dst[i] = bf16(x[i]) for n floats, n a multiple of 16 (round to nearest even, as jnp's astype).
inline void RoundToBf16(const float* x, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
  }
}

// The 16-bit lane indices (first, second + offset, first + 1, second + offset + 1, ...) for 16 pairs: which lanes
// of one or two vectors go into each pair of a 16-bit permute.
inline __m512i PairIndices(int first, int offset) {
  alignas(64) uint16_t index[32];
  for (int i = 0; i < 16; ++i) {
    index[2 * i] = static_cast<uint16_t>(first + i);
    index[2 * i + 1] = static_cast<uint16_t>(first + offset + i);
  }
  return _mm512_load_si512(index);
}

// Lanes (a[i], b[i]) as bf16 pairs, a in the low half; order = PairIndices(0, 16).
inline __m512i InterleaveBf16(__m512 a, __m512 b, __m512i order) {
  const __m512bh both = _mm512_cvtne2ps_pbh(b, a);  // a's 16 values, then b's
  return _mm512_permutexvar_epi16(order, reinterpret_cast<const __m512i&>(both));
}

// head.query_pairs from queries [rows, hd] (scaled floats); rows rows..rows_p - 1 become zeros. rounded: scratch of
// [rows_p, hd] bf16.
inline void PackQueries(const float* queries, int64_t rows, int64_t rows_p, int64_t hd, const PrefillHead& head,
                        uint16_t* rounded) {
  RoundToBf16(queries, rows * hd, rounded);
  std::fill(rounded + rows * hd, rounded + rows_p * hd, uint16_t{0});
  for (int64_t r = 0; r < rows_p; r += kTileRows) {  // [rows_p, hd / 2] pairs -> [hd / 2, rows_p]
    for (int64_t d = 0; d < hd / 2; d += 16) Transpose16(rounded + r * hd + 2 * d, hd / 2, head.query_pairs + d * rows_p + r, rows_p);
  }
}

// out rows r < rows (row r at out_rows(r), hd floats) = head.out_t [hd, rows_p] transposed, over the denominators.
template <typename RowAt>
inline void WriteOutputs(const PrefillHead& head, int64_t rows, int64_t rows_p, int64_t hd, const RowAt& out_rows) {
  alignas(64) float tile[kTileRows * kTileRows];
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    for (int64_t d0 = 0; d0 < hd; d0 += kTileRows) {
      Transpose16(head.out_t + d0 * rows_p + r0, rows_p, tile, kTileRows);
      for (int64_t i = 0; i < std::min<int64_t>(kTileRows, rows - r0); ++i) {
        const __m512 row = _mm512_mul_ps(_mm512_load_ps(tile + i * kTileRows),
                                         _mm512_set1_ps(1.0f / head.denom[r0 + i]));
        _mm512_storeu_ps(out_rows(r0 + i) + d0, row);
      }
    }
  }
}

// scores_t[t, 16 (c0 + c) ...] = keys[t] . queries of chunk c0 + c, for 4 keys and R chunks of 16 rows.
template <int R>
inline void KeyScores(const uint16_t* const* keys, const uint32_t* query_pairs, int64_t rows_p, int64_t hd,
                      int64_t c0, float* scores_t) {
  __m512 acc[4][R];
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < R; ++c) acc[t][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd / 2; ++d) {
    __m512i q[R];
    for (int c = 0; c < R; ++c) q[c] = _mm512_loadu_si512(query_pairs + d * rows_p + (c0 + c) * kTileRows);
    for (int t = 0; t < 4; ++t) {
      const __m512i k = BroadcastPair(keys[t] + 2 * d);
      for (int c = 0; c < R; ++c) acc[t][c] = DotPairs(acc[t][c], k, q[c]);
    }
  }
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < R; ++c) _mm512_storeu_ps(scores_t + t * rows_p + (c0 + c) * kTileRows, acc[t][c]);
}

// out_t[d0 + t, chunk c0 + c] = out_t * rescale + sum over key pairs jp < pairs of values . probabilities, for 4 dims
// and R chunks of 16 rows.
template <int R>
inline void AddValuePairs(const uint32_t* prob_pairs, const uint32_t* value_pairs, const float* rescale,
                          int64_t rows_p, int64_t hd, int64_t pairs, int64_t d0, int64_t c0, float* out_t) {
  __m512 acc[4][R];
  for (int c = 0; c < R; ++c) {
    const __m512 scale = _mm512_loadu_ps(rescale + (c0 + c) * kTileRows);
    for (int t = 0; t < 4; ++t) {
      acc[t][c] = _mm512_mul_ps(_mm512_loadu_ps(out_t + (d0 + t) * rows_p + (c0 + c) * kTileRows), scale);
    }
  }
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512i p[R];
    for (int c = 0; c < R; ++c) p[c] = _mm512_loadu_si512(prob_pairs + jp * rows_p + (c0 + c) * kTileRows);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_set1_epi32(static_cast<int32_t>(value_pairs[jp * hd + d0 + t]));
      for (int c = 0; c < R; ++c) acc[t][c] = DotPairs(acc[t][c], v, p[c]);
    }
  }
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < R; ++c) _mm512_storeu_ps(out_t + (d0 + t) * rows_p + (c0 + c) * kTileRows, acc[t][c]);
}

// f(std::integral_constant<int, R>{}, c) over chunks [begin, end) in groups of at most four, as even as they come
// (six chunks: 3 + 3): R x 4 sums and R vectors of the other operand stay in registers.
template <typename F>
inline void InChunkGroups(int64_t begin, int64_t end, F&& f) {
  const int64_t n = end - begin, groups = (n + 3) / 4;
  for (int64_t g = 0, c = begin; g < groups; ++g) {
    const int64_t size = (n - (c - begin) + (groups - g) - 1) / (groups - g);
    switch (size) {
      case 4: f(std::integral_constant<int, 4>{}, c); break;
      case 3: f(std::integral_constant<int, 3>{}, c); break;
      case 2: f(std::integral_constant<int, 2>{}, c); break;
      default: f(std::integral_constant<int, 1>{}, c); break;
    }
    c += size;
  }
}

// A block's geometry: keys key0 .. key0 + nkeys - 1 (nkeys <= block) against rows whose positions are row_pos
// [rows_p] (non-decreasing), a query at p seeing keys in (p - window, p] (window 0: no lower bound).
struct PrefillBlock {
  const uint16_t* const* keys;    // [nkeys rounded up to 4] bf16 rows of head_dim (past nkeys: any readable row)
  const uint16_t* const* values;  // [nkeys rounded up to 2]
  int64_t key0, nkeys, window;
  const int32_t* row_pos;
};

// Online softmax of chunk c's rows over the block's scores (scores_t [key, row]): the running max and denominator
// of head move on, s.rescale gets what the chunk's old outputs are scaled by, and s.prob_pairs [key pair, row] the
// probabilities as bf16 pairs. visible(j) masks the rows that see key j < nkeys.
template <typename Visible>
inline void ChunkSoftmax(const PrefillBlock& b, const PrefillHead& head, PrefillScratch& s, int64_t rows_p, int64_t c,
                         const Visible& visible) {
  // (raw pointers: s is thread-local, whose address the compiler would look up again after every store)
  const float* scores = s.scores_t.data() + c * kTileRows;
  uint32_t* const prob_pairs = s.prob_pairs.data() + c * kTileRows;
  float* const rescale_out = s.rescale.data() + c * kTileRows;
  __m512 block_max = _mm512_set1_ps(kNoScore);
  for (int64_t j = 0; j < b.nkeys; ++j) {
    block_max = _mm512_mask_max_ps(block_max, visible(j), block_max, _mm512_loadu_ps(scores + j * rows_p));
  }
  float* row_max = head.row_max + c * kTileRows;
  const __m512 old_max = _mm512_loadu_ps(row_max), new_max = _mm512_max_ps(block_max, old_max);
  const __m512 rescale = ExpNonPositive(_mm512_sub_ps(old_max, new_max));
  _mm512_storeu_ps(rescale_out, rescale);
  _mm512_storeu_ps(row_max, new_max);
  auto prob = [&](int64_t j) {
    return _mm512_maskz_mov_ps(visible(j), ExpNonPositive(_mm512_sub_ps(_mm512_loadu_ps(scores + j * rows_p), new_max)));
  };
  const __m512i order = PairIndices(0, 16);
  __m512 sums = _mm512_setzero_ps();
  int64_t jp = 0;
  for (; 2 * jp + 1 < b.nkeys; ++jp) {
    const __m512 first = prob(2 * jp), second = prob(2 * jp + 1);
    sums = _mm512_add_ps(sums, _mm512_add_ps(first, second));
    _mm512_storeu_si512(prob_pairs + jp * rows_p, InterleaveBf16(first, second, order));
  }
  if (2 * jp < b.nkeys) {  // an odd count: the last key pairs with a probability of 0
    const __m512 last = prob(2 * jp);
    sums = _mm512_add_ps(sums, last);
    _mm512_storeu_si512(prob_pairs + jp * rows_p, InterleaveBf16(last, _mm512_setzero_ps(), order));
  }
  float* denom = head.denom + c * kTileRows;
  _mm512_storeu_ps(denom, _mm512_fmadd_ps(_mm512_loadu_ps(denom), rescale, sums));
}

// One block of keys for one KV head: scores, online softmax, values into head.out_t; with `amx`, the two products on
// the tile unit (amx_prefill_attention.h; b.keys and b.values then hold rows up to nkeys rounded up to 32).
inline void AttendPrefillBlock(const PrefillBlock& b, const PrefillHead& head, PrefillScratch& s, int64_t rows_p,
                               int64_t hd, bool amx) {
  const int64_t chunks = rows_p / kTileRows;
  auto chunk_last = [&](int64_t c) { return static_cast<int64_t>(b.row_pos[c * kTileRows + kTileRows - 1]); };
  auto first_chunk = [&](int64_t j) {  // the first chunk with a row at or after key j (those before are all masked)
    int64_t first = 0;
    while (first < chunks && chunk_last(first) < b.key0 + j) ++first;
    return first;
  };
  float* scores_t = s.scores_t.data();
  const int64_t pairs = (b.nkeys + 1) / 2;
#if JVLLM_AMX
  const int64_t keys_p = (b.nkeys + kAmxKeys - 1) / kAmxKeys * kAmxKeys;
  if (amx) {
    GatherKeyRows(b.keys, keys_p, hd, s.key_rows.data());
    AmxKeyScores(s.key_rows.data(), keys_p, head.query_pairs, rows_p, hd, first_chunk, scores_t);
  }
#endif
  for (int64_t j = 0; j < b.nkeys && !amx; j += 4) {
    InChunkGroups(first_chunk(j), chunks, [&](auto group, int64_t c0) {
      KeyScores<decltype(group)::value>(b.keys + j, head.query_pairs, rows_p, hd, c0, scores_t + j * rows_p);
    });
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const bool all_visible = b.key0 + b.nkeys - 1 <= b.row_pos[c * kTileRows] &&
                             (b.window <= 0 || b.key0 > chunk_last(c) - b.window);
    if (all_visible) {
      ChunkSoftmax(b, head, s, rows_p, c, [](int64_t) -> __mmask16 { return 0xffff; });
    } else {
      const __m512i pos = _mm512_loadu_si512(b.row_pos + c * kTileRows);
      const __m512i after_window = _mm512_sub_epi32(pos, _mm512_set1_epi32(static_cast<int32_t>(b.window)));
      ChunkSoftmax(b, head, s, rows_p, c, [&](int64_t j) -> __mmask16 {  // rows of chunk c that see key j
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(b.key0 + j));
        const __mmask16 causal = _mm512_cmple_epi32_mask(key, pos);
        return b.window > 0 ? causal & _mm512_cmpgt_epi32_mask(key, after_window) : causal;
      });
    }
  }
  // values as key pairs: value_pairs[jp, d] = (v[2 jp][d], v[2 jp + 1][d]) (AMX: up to a multiple of 16 pairs)
  const int64_t value_pairs_made = amx ? (pairs + 15) / 16 * 16 : pairs;
  const __m512i low = PairIndices(0, 32), high = PairIndices(16, 32);
  uint32_t* const value_pairs = s.value_pairs.data();
  for (int64_t jp = 0; jp < value_pairs_made; ++jp) {
    for (int64_t d = 0; d < hd; d += 32) {
      const __m512i a = _mm512_loadu_si512(b.values[2 * jp] + d), c = _mm512_loadu_si512(b.values[2 * jp + 1] + d);
      _mm512_storeu_si512(value_pairs + jp * hd + d, _mm512_permutex2var_epi16(a, low, c));
      _mm512_storeu_si512(value_pairs + jp * hd + d + 16, _mm512_permutex2var_epi16(a, high, c));
    }
  }
  // chunks need only the key pairs their last row sees
  auto seen_pairs = [&](int64_t c) { return (std::clamp<int64_t>(chunk_last(c) - b.key0 + 1, 0, b.nkeys) + 1) / 2; };
  const uint32_t* const prob_pairs = s.prob_pairs.data();
  const float* const rescale = s.rescale.data();
#if JVLLM_AMX
  if (amx) {
    TransposeValuePairs(value_pairs, value_pairs_made, hd, s.value_pairs_t.data());
    AmxAddValues(s.value_pairs_t.data(), value_pairs_made, prob_pairs, rescale, rows_p, hd, seen_pairs, head.out_t);
    return;
  }
#endif
  InChunkGroups(0, chunks, [&](auto group, int64_t c0) {
    constexpr int R = decltype(group)::value;
    const int64_t seen = seen_pairs(c0 + R - 1);
    for (int64_t d0 = 0; d0 < hd; d0 += 4) {
      AddValuePairs<R>(prob_pairs, value_pairs, rescale, rows_p, hd, seen, d0, c0, head.out_t);
    }
  });
}
// A block of one sequence's queries: `rows` = queries x group rows per KV head (row r is query r / group) at
// positions first_pos + r / group, attending to keys from `lowest` on (window: a query at p sees keys > p - window).
struct PrefillQueries {
  const float* queries;  // [heads, rows, hd] scaled
  int64_t heads, rows, group, hd, first_pos, lowest, window;
};

// The attention of a block of prefill queries over its sequence's keys, block_keys (<= kMaxBlockKeys) at a time, for every KV
// head h < q.heads. row_at(h, pos, k_buf, v_buf, &key, &value) points key and value at the bf16 rows of head h at
// position pos (filling k_buf / v_buf [hd] if they must be made); prefetch(key0, nkeys) is told the next block; the
// output row of head h's row r goes to out_row(h, r) [hd].
template <typename RowAt, typename Prefetch, typename OutRow>
inline void AttendPrefillQueries(const PrefillQueries& q, int64_t block_keys, const RowAt& row_at,
                                 const Prefetch& prefetch, const OutRow& out_row) {
  thread_local PrefillScratch tiles;
  const int64_t hd = q.hd, rows_p = (q.rows + kTileRows - 1) / kTileRows * kTileRows;
  tiles.Reserve(q.heads, rows_p, hd, block_keys);
  int32_t* const row_pos = tiles.row_pos.data();  // (raw pointers: tiles is thread-local)
  uint16_t* const converted = tiles.converted.data();
  const uint16_t* const zero_row = tiles.zero_row.data();
  for (int64_t r = 0; r < rows_p; ++r) row_pos[r] = static_cast<int32_t>(q.first_pos + std::min(r, q.rows - 1) / q.group);
  for (int64_t h = 0; h < q.heads; ++h) {
    const PrefillHead head = tiles.Head(h, rows_p, hd);
    PackQueries(q.queries + h * q.rows * hd, q.rows, rows_p, hd, head, converted);
    std::fill(head.out_t, head.out_t + hd * rows_p, 0.0f);
    std::fill(head.row_max, head.row_max + rows_p, kNoScore);
    std::fill(head.denom, head.denom + rows_p, 0.0f);
  }
  const int64_t last_pos = q.first_pos + q.rows / q.group - 1;
  const uint16_t *keys[kMaxBlockKeys], *values[kMaxBlockKeys];
#if JVLLM_AMX
  const bool amx = hd % 32 == 0 && block_keys % kAmxKeys == 0 && AmxUsable();
  std::optional<AmxTileScope> amx_tiles;
  if (amx) amx_tiles.emplace();
#else
  const bool amx = false;
#endif
  for (int64_t key0 = q.lowest; key0 <= last_pos; key0 += block_keys) {
    const int64_t nkeys = std::min<int64_t>(block_keys, last_pos + 1 - key0);
    prefetch(key0 + block_keys, std::min<int64_t>(block_keys, last_pos + 1 - key0 - block_keys));
    for (int64_t h = 0; h < q.heads; ++h) {
      for (int64_t j = 0; j < block_keys; ++j) {
        if (j < nkeys) {
          row_at(h, key0 + j, converted + j * hd, converted + (block_keys + j) * hd, &keys[j], &values[j]);
        } else {
          keys[j] = values[j] = zero_row;
        }
      }
      AttendPrefillBlock({keys, values, key0, nkeys, q.window, row_pos}, tiles.Head(h, rows_p, hd), tiles, rows_p, hd,
                         amx);
    }
  }
  for (int64_t h = 0; h < q.heads; ++h) {
    WriteOutputs(tiles.Head(h, rows_p, hd), q.rows, rows_p, hd, [&](int64_t r) { return out_row(h, r); });
  }
}
#else
constexpr bool kBf16Prefill = false;  // the float loops of paged_attention.cc run instead
#endif

}  // namespace jvllm
