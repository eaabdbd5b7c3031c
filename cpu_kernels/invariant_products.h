// Products with GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) whose every output is computed the same way
// whatever rows of x come with it, at any row count: x is quantized to int16 per block of 32 (int16_dots.h: 15
// bits, 14 for Q6_K, whose 16-bit codes carry its group scales as int16_tiles.h folds them), each 32-weight
// (sub-)block's products are summed in int32 (exact, so the order of the sums does not matter), and each output
// takes its blocks' scaled sums in one float32 chain, in block order:
//   f += c[n, b] * xs[m, b];  f += float(codes[n, b] . xq[m, b]) * (d[n, b] * xd[m, b])
// A one-token decode step and the same token among draft tokens in a verification step then get the same bits, and
// both are within ~3e-5 of the float32 product (the int16 path's precision).
//
// Layout: per 16 weight rows and block, the rows' code words are loaded and transposed in registers so that each
// 32-bit lane holds two codes of one row (16 pair vectors a block, one per pair of weights), and every row of x
// meets them through broadcasts of its matching code pairs (x's codes permuted once per call to the pairs' order):
// 16 `vpdpwssd` per row of x and block, with no tiles kept in memory: up to 16 rows as fast as the other paths or
// faster, past that slower than the bf16 tiles (docs/design/speculative_decoding.md). Q8_0 / Q4_0 / Q4_1 weights
// grouped by code words (word_group_blocks.h) are loaded as the pair vectors' words with no transpose; their pairs
// are other weights' (x's permutation follows), and the exact block sums give the row-major blocks' bits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "block_formats.h"
#include "int16_dots.h"

namespace jvllm {

template <typename Fmt>
constexpr bool kInvariantProducts = JVLLM_INT16_512;  // every block format

// Whether a product of `m` rows takes the invariant path: the build has it (AVX-512) and the rows are within the
// caller's limit (0: never).
template <typename Fmt>
constexpr bool TakesInvariantProduct(int64_t m, int64_t max_rows) {
  return kInvariantProducts<Fmt> && m <= max_rows;
}

}  // namespace jvllm

#if JVLLM_INT16_512
#include <immintrin.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "amx_block_sums.h"
#include "float_tiles.h"
#include "int16_tiles.h"
#include "line_aligned.h"
#include "run_items.h"
#include "vector_exp.h"
#include "word_group_blocks.h"

namespace jvllm {

template <typename Fmt>
class InvariantProduct {
 public:
  static constexpr bool kSigned = std::is_same_v<Fmt, Q8_0> || std::is_same_v<Fmt, Q8_0x16>;  // signed 8-bit codes
  static constexpr bool kKQuant = Fmt::kWeights == 256;       // 256-weight blocks of 8 sub-blocks of 32
  static constexpr bool kFourPairsAWord = !kSigned && !kKQuant;  // Q4_0, Q4_1: a code word holds 4 pairs' nibbles
  static constexpr bool kConstants = !kSigned && !std::is_same_v<Fmt, Q6_K>;  // blocks with a constant term c
  static constexpr int kHeader = kKQuant ? 0 : Fmt::kBytes - (kSigned ? 32 : 16);
  static constexpr int kPairs = 16;  // pairs of weights a block
#if JVLLM_AMX_INT8
  static constexpr int64_t kChunk = kAmxChunkGroups;  // groups of 16 columns whose sums are made together
#else
  static constexpr int64_t kChunk = 1;
#endif

  // x [M, K] quantized with 32767 as the largest code, then each block's codes permuted to the pairs' order.
  InvariantProduct(int64_t m, int64_t k, int64_t n, const float* x, const uint8_t* w, float* y,
                   const uint8_t* up = nullptr)
      : m_(m), n_(n), blocks_(k / 32), w_(w), up_(up), y_(y) {
    thread_local Int16Rows xq;
    thread_local std::vector<int16_t> pairs;
    xq.Quantize(x, m, k, Int16Limit<Fmt>());
    xq_ = &xq;
#if JVLLM_AMX_INT8
    if constexpr (kWordGroups<Fmt>) {
      if (m >= AmxBlockSumMinRows() && m <= kAmxBlockSumRows && AmxUsable()) {
        thread_local AmxCodeBytes bytes;
        bytes.Split(xq.q.data(), m, blocks_);
        amx_x_ = &bytes;
        return;
      }
    }
#endif
    GrowTo(pairs, static_cast<size_t>(m * k));
    const __m512i order = PairOrder();
    for (int64_t b = 0; b < m * blocks_; ++b) {
      const __m512i codes = _mm512_loadu_si512(xq.q.data() + b * 32);
      _mm512_storeu_si512(pairs.data() + b * 32, _mm512_permutexvar_epi16(order, codes));
    }
    x_pairs_ = reinterpret_cast<const int32_t*>(pairs.data());
  }

  int64_t num_groups() const { return (n_ + 15) / 16; }

  // Output columns [16 g0, 16 g1).
  void Run(int64_t g0, int64_t g1) const {
    // [2, kChunk, M, 16]: a chunk of groups' float sums (gated: the gate's, then the up's)
    thread_local std::vector<float> sums;
    GrowTo(sums, static_cast<size_t>(2 * kChunk * m_ * 16));
#if JVLLM_AMX_INT8
    std::optional<AmxBlockSumScope> tiles;
    if (amx_x_ != nullptr) tiles.emplace(m_);
#endif
    float* up_sums = sums.data() + kChunk * m_ * 16;
    for (int64_t g = g0; g < g1; g += kChunk) {
      const int64_t count = std::min(kChunk, g1 - g);
      // the range's first chunk: nothing asked for its weights before (later chunks are, a chunk ahead)
      ChunkSums(w_, g, count, g == g0, sums.data());
      if (up_ != nullptr) ChunkSums(up_, g, count, g == g0, up_sums);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t n = 16 * (g + j);
        const int cols = static_cast<int>(std::min<int64_t>(16, n_ - n));
        const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1u);
        for (int64_t r = 0; r < m_; ++r) {
          const int64_t at = (j * m_ + r) * 16;
          __m512 out = _mm512_loadu_ps(sums.data() + at);
          if (up_ != nullptr) out = _mm512_mul_ps(Silu512(out), _mm512_loadu_ps(up_sums + at));
          _mm512_mask_storeu_ps(y_ + r * n_ + n, live, out);
        }
      }
    }
  }

 private:
  // The weights of pair p of a block (p = 4t + j for Q4_0 / Q4_1, else 2t + j; t the code word): x's permutation.
  // Q4_0 / Q4_1, from word t (low nibbles: weights 4t .. 4t + 3, high: 16 + 4t ..): j = 0: (4t, 4t + 2),
  // 1: (4t + 1, 4t + 3), 2: (16 + 4t, 18 + 4t), 3: (17 + 4t, 19 + 4t). The others (word t of a (sub-)block's codes:
  // weights 4t .. 4t + 3): j = 0: (4t, 4t + 2), 1: (4t + 1, 4t + 3).
  // Word groups: WordGroupPairFirst's neighbours.
  static __m512i PairOrder() {
    alignas(64) int16_t order[32];
    for (int p = 0; p < kPairs; ++p) {
      if constexpr (kWordGroups<Fmt>) {
        order[2 * p] = static_cast<int16_t>(WordGroupPairFirst<Fmt>(p));
        order[2 * p + 1] = static_cast<int16_t>(WordGroupPairFirst<Fmt>(p) + 1);
        continue;
      }
      const int t = kFourPairsAWord ? p / 4 : p / 2, j = kFourPairsAWord ? p % 4 : p % 2;
      const int first = 4 * t + (j & 1) + (j >= 2 ? 16 : 0);
      order[2 * p] = static_cast<int16_t>(first);
      order[2 * p + 1] = static_cast<int16_t>(first + 2);
    }
    return _mm512_load_si512(order);
  }

  // The 4 words of the 16 rows' 16 bytes from `offset` -> word t in out[t], lane r from row r.
  static void TransposeWords(const uint8_t* const (&rows)[16], int64_t offset, __m512i* out) {
    __m512i z[4];  // z[g]: rows g, g + 4, g + 8, g + 12 in its 128-bit lanes
    for (int g = 0; g < 4; ++g) {
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[g] + offset)));
      for (int lane = 1; lane < 4; ++lane) {
        const __m128i row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[g + 4 * lane] + offset));
        v = _mm512_inserti32x4(v, row, lane);
      }
      z[g] = v;
    }
    const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(a0, a2);
    out[1] = _mm512_unpackhi_epi64(a0, a2);
    out[2] = _mm512_unpacklo_epi64(a1, a3);
    out[3] = _mm512_unpackhi_epi64(a1, a3);
  }

  // What a K-quant block of 16 rows shares among its sub-blocks: the scales, decoded as the other paths decode them
  // (Fmt::Scales: sub-block s's d and c), Q6_K's group scales g as int16 twice in each 32-bit lane, and the words of
  // Q5_K's fifth bits (all sub-blocks) or of Q6_K's high bits (4 sub-blocks), transposed as the codes.
  struct BlockScales {
    alignas(64) float d[8][16];
    alignas(64) float c[8][16];
    __m512i groups[16];
    __m512i top[8];
  };

  // The 8 words of the 16 rows' 32 bytes from `offset` -> out[t], lane r from row r.
  static void TransposeWords32(const uint8_t* const (&rows)[16], int64_t offset, __m512i* out) {
    TransposeWords(rows, offset, out);
    TransposeWords(rows, offset + 16, out + 4);
  }

  static void ScalesOf(const uint8_t* const (&rows)[16], int64_t at, BlockScales& out) {
    for (int r = 0; r < 16; ++r) {
      float d[8], c[8];
      Fmt::Scales(rows[r] + at, d, c);
      for (int s = 0; s < 8; ++s) {
        out.d[s][r] = d[s];
        out.c[s][r] = c[s];
      }
    }
    if constexpr (std::is_same_v<Fmt, Q6_K>) {  // group g: byte g % 4 of word g / 4, sign-extended
      __m512i words[4];
      TransposeWords(rows, reinterpret_cast<const uint8_t*>(Fmt::GroupScales(rows[0] + at, 0)) - rows[0], words);
      for (int g = 0; g < 16; ++g) {
        const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(words[g / 4], 24 - 8 * (g % 4)), 24);
        out.groups[g] = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(v, 16));
      }
    }
  }

  // Sub-block s of K-quant block `at` of the 16 rows -> its pair vectors (scales: ScalesOf the block, with `top`
  // holding the high or fifth bits that s reads).
  static void SubBlockPairs(const uint8_t* const (&rows)[16], int64_t at, int s, const BlockScales& scales,
                            __m512i (&pairs)[kPairs]) {
    __m512i words[8];  // the sub-block's code words
    const __m512i* top = scales.top;
    if constexpr (std::is_same_v<Fmt, Q6_K>) {
      const int low_shift = (s % 4) < 2 ? 0 : 4, high_shift = 2 * (s % 4);
      TransposeWords32(rows, Fmt::Low(rows[0] + at, s) - rows[0], words);
      const __m512i nibble = _mm512_set1_epi32(0x000F000F), two_bits = _mm512_set1_epi32(0x00030003);
      const __m512i bias = _mm512_set1_epi16(32);
      for (int t = 0; t < 8; ++t) {
        const __m512i group = scales.groups[2 * s + t / 4];
        for (int j = 0; j < 2; ++j) {
          const __m512i low = _mm512_and_si512(_mm512_srli_epi32(words[t], low_shift + 8 * j), nibble);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi32(top[t], high_shift + 8 * j), two_bits);
          const __m512i q = _mm512_or_si512(low, _mm512_slli_epi32(high, 4));
          pairs[2 * t + j] = _mm512_mullo_epi16(_mm512_sub_epi16(q, bias), group);
        }
      }
    } else {
      const int shift = 4 * (s & 1);
      TransposeWords32(rows, at + Fmt::kQs + 32 * (s / 2), words);
      const __m512i nibble = _mm512_set1_epi32(0x000F000F), bit = _mm512_set1_epi32(0x00010001);
      for (int t = 0; t < 8; ++t) {
        for (int j = 0; j < 2; ++j) {
          __m512i q = _mm512_and_si512(_mm512_srli_epi32(words[t], shift + 8 * j), nibble);
          if constexpr (Fmt::kMaxCode > 15) {
            q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(top[t], s + 8 * j), bit), 4));
          }
          pairs[2 * t + j] = q;
        }
      }
    }
  }

  // Block b (a sub-block for the K-quants) of the 16 rows -> its 16 pair vectors (lane r: row r's two codes of the
  // pair, as int16) and the rows' scales d and constants c (c unused for Q8_0 and Q6_K). `scales`: the K-quants'
  // decoded scales, filled at a block's first sub-block.
  static void BlockPairs(const uint8_t* const (&rows)[16], __mmask16 live, int64_t b, BlockScales& scales,
                         __m512i (&pairs)[kPairs], __m512& d, __m512& c) {
    if constexpr (kWordGroups<Fmt>) {  // the group's 16 rows are one run of memory from rows[0]
      const uint8_t* block = rows[0] + b * Fmt::kGroupBytes;
      WordGroupScales<Fmt>(block, d, c);
      WordGroupPairs<Fmt>(block, pairs);
      return;
    } else if constexpr (kKQuant) {
      const int64_t at = b / 8 * Fmt::kBytes;
      const int s = static_cast<int>(b % 8);
      if (s == 0) ScalesOf(rows, at, scales);
      if constexpr (std::is_same_v<Fmt, Q6_K>) {
        if (s % 4 == 0) TransposeWords32(rows, Fmt::High(rows[0] + at, s) - rows[0], scales.top);
      } else if constexpr (Fmt::kMaxCode > 15) {
        if (s == 0) TransposeWords32(rows, at + 16, scales.top);
      }
      SubBlockPairs(rows, at, s, scales, pairs);
      d = _mm512_load_ps(scales.d[s]);
      c = _mm512_load_ps(scales.c[s]);
      return;
    }
    const int64_t at = b * Fmt::kBytes;
    __m512i words[4];
    TransposeWords(rows, at, words);  // words[0]: each row's block header (the rest unused: cheaper than a gather)
    const __m512i header = _mm512_maskz_mov_epi32(live, words[0]);
    d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header));
    if constexpr (std::is_same_v<Fmt, Q4_1>) {
      c = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header, 16)));
    } else if constexpr (std::is_same_v<Fmt, Q4_0>) {
      c = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    }
    for (int half = 0; half < (kSigned ? 2 : 1); ++half) {
      TransposeWords(rows, at + kHeader + 16 * half, words);
      for (int t = 0; t < 4; ++t) {
        if constexpr (kSigned) {
          __m512i* p = pairs + 2 * (4 * half + t);
          p[0] = _mm512_srai_epi16(_mm512_slli_epi16(words[t], 8), 8);
          p[1] = _mm512_srai_epi16(words[t], 8);
        } else {
          const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
          __m512i* p = pairs + 4 * t;
          p[0] = _mm512_and_si512(words[t], nibbles);
          p[1] = _mm512_and_si512(_mm512_srli_epi32(words[t], 8), nibbles);
          p[2] = _mm512_and_si512(_mm512_srli_epi32(words[t], 4), nibbles);
          p[3] = _mm512_and_si512(_mm512_srli_epi32(words[t], 12), nibbles);
        }
      }
    }
  }

  // sums [count, M, 16] = the float sums of x against weight groups [g, g + count) of `w`; `cold`: their weights
  // were not asked for ahead (the first chunk of a range).
  void ChunkSums(const uint8_t* w, int64_t g, int64_t count, bool cold, float* sums) const {
    const int64_t row_bytes = blocks_ / Fmt::kSubs * Fmt::kBytes;
#if JVLLM_AMX_INT8
    if constexpr (kWordGroups<Fmt>) {
      if (amx_x_ != nullptr) {
        AmxWordGroupSums<Fmt, kConstants>(w + 16 * g * row_bytes, count, blocks_, m_, *amx_x_, xq_->d.data(),
                                          xq_->s.data(), cold, sums);
        return;
      }
    }
#endif
    for (int64_t j = 0; j < count; ++j) {
      const int64_t n = 16 * (g + j);
      GroupSums(w, n, static_cast<int>(std::min<int64_t>(16, n_ - n)), cold && j == 0, sums + j * m_ * 16);
    }
  }

  // sums[r, 0 .. 16) = the float sums of rows r of x against weight rows [n, n + cols) (`w`); `cold`: these rows
  // were not asked for ahead.
  void GroupSums(const uint8_t* w, int64_t n, int cols, bool cold, float* sums) const {
    const int64_t row_bytes = blocks_ / Fmt::kSubs * Fmt::kBytes;
    const uint8_t* rows[16];  // rows past `cols` repeat the last one (their sums are not stored)
    for (int r = 0; r < 16; ++r) rows[r] = w + (n + std::min(r, cols - 1)) * row_bytes;
    const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1u);
    for (int64_t r = 0; r < m_; ++r) _mm512_storeu_ps(sums + r * 16, _mm512_setzero_ps());
    // The 16 rows are one run of memory, read here a block of each row at a time: the next group's run is asked for
    // along the way, as many lines a (sub-)block as a (sub-)block of 16 rows spans.
    constexpr int kLinesPerBlock = (16 * Fmt::kBytes / Fmt::kSubs + 63) / 64;
    BlockScales scales;
    const char* next_group = reinterpret_cast<const char*>(w + (n + 16) * row_bytes);
    const char* this_group = reinterpret_cast<const char*>(w + n * row_bytes);
    if (cold) {
      for (int line = 0; line < kColdAheadBlocks * kLinesPerBlock; ++line) {
        _mm_prefetch(this_group + line * 64, _MM_HINT_T0);
      }
    }
    for (int64_t b = 0; b < blocks_; ++b) {
      for (int line = 0; line < kLinesPerBlock; ++line) {
        _mm_prefetch(next_group + (b * kLinesPerBlock + line) * 64, _MM_HINT_T0);
        if (cold) _mm_prefetch(this_group + ((b + kColdAheadBlocks) * kLinesPerBlock + line) * 64, _MM_HINT_T0);
      }
      __m512i pairs[kPairs];
      __m512 d, c = _mm512_setzero_ps();
      BlockPairs(rows, live, b, scales, pairs, d, c);
      int64_t r = 0;
      for (; r + 8 <= m_; r += 8) RowsTimesBlock<8>(pairs, d, c, b, r, sums);
      if (m_ - r >= 4) RowsTimesBlock<4>(pairs, d, c, b, r, sums), r += 4;
      if (m_ - r >= 2) RowsTimesBlock<2>(pairs, d, c, b, r, sums), r += 2;
      if (m_ - r >= 1) RowsTimesBlock<1>(pairs, d, c, b, r, sums);
    }
  }

  // Rows [r, r + R) of x against block b's pairs: each row's int32 sums in kChains chains (added exactly), then
  // the block's term added to its float sums.
  template <int R>
  void RowsTimesBlock(const __m512i (&pairs)[kPairs], __m512 d, __m512 c, int64_t b, int64_t r, float* sums) const {
    constexpr int kChains = 8 / R;  // 8 independent chains of `vpdpwssd` at any R
    // in locals: the float sums' stores below are unaligned vector stores, which may alias anything, so members read
    // after them would be read again for every row
    const int32_t* const x_pairs = x_pairs_;
    const float* const xd = xq_->d.data();
    const float* const xs = xq_->s.data();
    const int64_t blocks = blocks_;
    __m512i acc[R][kChains];
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < kChains; ++j) acc[i][j] = _mm512_setzero_si512();
    }
#pragma GCC unroll 16
    for (int p = 0; p < kPairs; ++p) {
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i x = _mm512_set1_epi32(x_pairs[((r + i) * blocks + b) * kPairs + p]);
        acc[i][p % kChains] = AddPairProducts(acc[i][p % kChains], pairs[p], x);
      }
    }
    for (int i = 0; i < R; ++i) {
      __m512i total = acc[i][0];
      for (int j = 1; j < kChains; ++j) total = _mm512_add_epi32(total, acc[i][j]);
      const int64_t row_block = (r + i) * blocks + b;
      AddBlockTerm<kConstants>(sums + (r + i) * 16, total, d, c, xd[row_block], xs[row_block]);
    }
  }

  int64_t m_, n_, blocks_;
  const uint8_t* w_;
  const uint8_t* up_;  // gated: the up weights (w_ then holds the gate's)
  float* y_;
  const Int16Rows* xq_ = nullptr;
  const int32_t* x_pairs_ = nullptr;  // [M, blocks, 16]: x's code pairs in the pairs' order
#if JVLLM_AMX_INT8
  const AmxCodeBytes* amx_x_ = nullptr;  // x's code bytes where the block sums run on the tile unit
#endif
};

// y[M, N] = x . W^T (or, with `up`, silu(x . W^T) * (x . U^T)) on the invariant path: groups of 16 output columns,
// as evenly split as they allow, shared by the caller and the helper threads.
template <typename Fmt>
void RunInvariantProduct(int64_t m, int64_t k, int64_t n, const float* x, const uint8_t* w, float* y,
                         const uint8_t* up = nullptr) {
  if constexpr (kInvariantProducts<Fmt>) {  // other formats: TakesInvariantProduct says no first
    struct Items {
      InvariantProduct<Fmt> product;
      int64_t groups_per_item;
      int64_t num_items() const { return (product.num_groups() + groups_per_item - 1) / groups_per_item; }
      void Run(int64_t item) const {
        const int64_t g0 = item * groups_per_item;
        product.Run(g0, std::min(product.num_groups(), g0 + groups_per_item));
      }
    };
    Items items{InvariantProduct<Fmt>(m, k, n, x, w, y, up), 0};
    const int64_t threads = HelperPool::Get().num_helpers() + 1;
    items.groups_per_item = BalancedUnits(items.product.num_groups(), threads);
    RunItems(items);
  }
}

}  // namespace jvllm
#else
namespace jvllm {
template <typename Fmt>
void RunInvariantProduct(int64_t, int64_t, int64_t, const float*, const uint8_t*, float*, const uint8_t* = nullptr) {}
}  // namespace jvllm
#endif
