// The invariant path's exact block sums (invariant_products.h) on the AMX tile unit, for few rows of x against
// word-grouped Q8_0 / Q4_0 / Q4_1 weights (block_formats.h, WordGroups32). x's int16 codes q are split into bytes,
// q = 256 h + l (h signed, l unsigned), and a block's 32 products summed by 8-bit tile products (`tdpb*d`: int32
// sums of 4-byte dot products) as H and L, 256 H + L: exact, so every row's block sums are the bits the `vpdpwssd`
// loops give, and each output's float chain (AddBlockTerm, in block order) is the same too. A row then has the same
// bits on either path and at any row count.
//
// Per 16 weight rows and block the weight tile is [8 rows, 64 bytes]: row i holds, for each of the 16 weight rows,
// the codes of 4 weights. A word group's word t (64 bytes: row r's code bytes 4t, 4t + 2, 4t + 1, 4t + 3 at 4r) is
// that for Q8_0 as it lies in memory; Q4's low nibbles give weights (4t, 4t + 2, 4t + 1, 4t + 3), its high nibbles
// the same 16 later. x's codes follow: column c of a block holds weight (c & ~3) + {0, 2, 1, 3}[c & 3].
#pragma once

#include "amx_tiles.h"

#if JVLLM_AMX && defined(__AMX_INT8__)
#define JVLLM_AMX_INT8 1
#else
#define JVLLM_AMX_INT8 0
#endif

#if JVLLM_AMX_INT8
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "block_formats.h"
#include "int16_dots.h"
#include "line_aligned.h"
#include "word_group_blocks.h"

namespace jvllm {

constexpr int64_t kAmxBlockSumRows = 16;  // rows of x a tile holds: the most rows this path takes
// Up to this many rows, x's high bytes (offset to unsigned), its low bytes and a row of ones share one tile, so a
// block of 16 weight rows is one tile product and one tile of sums stored: storing a tile costs more than the
// product of a few rows (~15 cycles against ~7 for 6 rows, 2-core Xeon VM).
constexpr int64_t kAmxOneTileRows = 7;

// The fewest rows of x whose block sums run on the tile unit (JVLLM_AMX_BLOCK_SUM_ROWS while measuring): with the
// weights streaming from L3 on 2 MiB pages, as in a model's step, 2 rows are no faster than the vector loops
// (docs/design/cpu_amx.md has the measurements).
inline int64_t AmxBlockSumMinRows() {
  static const int64_t rows = [] {
    const char* setting = std::getenv("JVLLM_AMX_BLOCK_SUM_ROWS");
    return setting == nullptr ? int64_t{3} : static_cast<int64_t>(std::atoi(setting));
  }();
  return rows;
}

// Rows of x's byte tiles a block holds for m rows of x: 2m + 1 in one tile, else two tiles of m.
constexpr int64_t AmxCodeRows(int64_t m) { return m <= kAmxOneTileRows ? 2 * m + 1 : 2 * m; }

struct alignas(64) AmxTileConfig {
  uint8_t bytes[64];
};

// The tiles for m rows of x. m <= kAmxOneTileRows: tile 0 x [2m + 1, 32], 2-3 weight tiles [8, 64], 4-7 four
// groups' sums [2m + 1, 64]. Else: tiles 0-1 x's high and low bytes [m, 32], 2-3 weight tiles, 4-5 and 6-7 two
// groups' sums (high, low) [m, 64]. Palette 1; bytes 16-47 each tile's bytes a row (16-bit), 48-63 its rows.
constexpr AmxTileConfig BlockSumConfig(int m) {
  AmxTileConfig config{};
  config.bytes[0] = 1;
  const bool one = m <= kAmxOneTileRows;
  const int x_rows = one ? 2 * m + 1 : m;
  const int rows[8] = {x_rows, one ? 0 : m, 8, 8, x_rows, x_rows, x_rows, x_rows};
  const int row_bytes[8] = {32, one ? 0 : 32, 64, 64, 64, 64, 64, 64};
  for (int t = 0; t < 8; ++t) {
    config.bytes[16 + 2 * t] = static_cast<uint8_t>(row_bytes[t]);
    config.bytes[48 + t] = static_cast<uint8_t>(rows[t]);
  }
  return config;
}

// Constants in read-only memory (see AmxTileScope), one per row count 0 .. 16.
inline constexpr AmxTileConfig kBlockSumConfigs[kAmxBlockSumRows + 1] = {
    BlockSumConfig(0), BlockSumConfig(1), BlockSumConfig(2), BlockSumConfig(3), BlockSumConfig(4),
    BlockSumConfig(5), BlockSumConfig(6), BlockSumConfig(7), BlockSumConfig(8), BlockSumConfig(9),
    BlockSumConfig(10), BlockSumConfig(11), BlockSumConfig(12), BlockSumConfig(13), BlockSumConfig(14),
    BlockSumConfig(15), BlockSumConfig(16)};

// This thread's tiles configured for `m` rows of block sums, released at the end of the scope.
class AmxBlockSumScope {
 public:
  explicit AmxBlockSumScope(int64_t m) { _tile_loadconfig(kBlockSumConfigs[m].bytes); }
  ~AmxBlockSumScope() { _tile_release(); }
  AmxBlockSumScope(const AmxBlockSumScope&) = delete;
  AmxBlockSumScope& operator=(const AmxBlockSumScope&) = delete;
};

// x's int16 codes q = 256 h + l (Int16Rows::q [M, K], M <= 16) as the tiles' operands, per block [AmxCodeRows(M),
// 32] bytes in one run, columns in the weight tiles' order. Up to kAmxOneTileRows rows: h + 128 (unsigned), l, a
// row of ones (its products are the weights' sum, which takes the 128 back out). More: h (signed), then l.
struct AmxCodeBytes {
  LineAlignedVector<uint8_t> bytes;  // [K / 32, AmxCodeRows(M), 32]

  void Split(const int16_t* q, int64_t m, int64_t blocks) {
    const int64_t rows = AmxCodeRows(m);
    const bool one = m <= kAmxOneTileRows;
    GrowTo(bytes, static_cast<size_t>(blocks * rows * 32));
    alignas(64) int16_t order[32];
    constexpr int kWithinWord[4] = {0, 2, 1, 3};
    for (int c = 0; c < 32; ++c) order[c] = static_cast<int16_t>((c & ~3) + kWithinWord[c & 3]);
    const __m512i permute = _mm512_load_si512(order);
    const __m256i offset = _mm256_set1_epi8(static_cast<char>(one ? 0x80 : 0));  // h + 128 as a byte: h ^ 0x80
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = bytes.data() + b * rows * 32;
      for (int64_t r = 0; r < m; ++r) {
        const __m512i codes = _mm512_permutexvar_epi16(permute, _mm512_loadu_si512(q + (r * blocks + b) * 32));
        const __m256i high = _mm256_xor_si256(_mm512_cvtepi16_epi8(_mm512_srai_epi16(codes, 8)), offset);
        _mm256_store_si256(reinterpret_cast<__m256i*>(block + r * 32), high);
        _mm256_store_si256(reinterpret_cast<__m256i*>(block + (m + r) * 32), _mm512_cvtepi16_epi8(codes));
      }
      if (one) _mm256_store_si256(reinterpret_cast<__m256i*>(block + 2 * m * 32), _mm256_set1_epi8(1));
    }
  }
};

// One block of one group on the tile unit: weight tile `weights` into tile W, x (tile 0) times it into tile S,
// stored to `out` [2m + 1, 16] int32. x's bytes are unsigned; Q8_0's codes signed, Q4's unsigned. (Macros: GCC's
// tile intrinsics paste their tile numbers into the assembly, so they cannot be template arguments.)
#define JVLLM_ONE_TILE_SUMS(W, S, weights, out) \
  do {                                          \
    _tile_loadd(W, weights, 64);                \
    _tile_zero(S);                              \
    if constexpr (Fmt::kSigned) {               \
      _tile_dpbusd(S, 0, W);                    \
    } else {                                    \
      _tile_dpbuud(S, 0, W);                    \
    }                                           \
    _tile_stored(S, out, 64);                   \
  } while (0)

// The same with x's high bytes (signed, tile 0) and low bytes (tile 1) apart: sums to `high` and `low` [m, 16].
#define JVLLM_TWO_TILE_SUMS(W, H, L, weights, high, low) \
  do {                                                   \
    _tile_loadd(W, weights, 64);                         \
    _tile_zero(H);                                       \
    _tile_zero(L);                                       \
    if constexpr (Fmt::kSigned) {                        \
      _tile_dpbssd(H, 0, W);                             \
      _tile_dpbusd(L, 1, W);                             \
    } else {                                             \
      _tile_dpbsud(H, 0, W);                             \
      _tile_dpbuud(L, 1, W);                             \
    }                                                    \
    _tile_stored(H, high, 64);                           \
    _tile_stored(L, low, 64);                            \
  } while (0)

constexpr int64_t kAmxChunkGroups = 8;  // word groups a call of AmxWordGroupSums takes (its buffers' size)

// The float sums of x's M rows against `count` (<= kAmxChunkGroups) word groups of 16 weight rows from `groups`
// (their first block; `blocks` blocks a group): sums [count, M, 16] = each row's block terms in block order
// (AddBlockTerm), xd and xs Int16Rows' d and s [M, blocks]. Needs an AmxBlockSumScope(M) on the thread. Blocks are
// the outer loop: per block, the groups' weight tiles are made first (Q4: nibbles split by vector stores, which a
// tile load right after would wait for), then multiplied and stored, then the float chains read the sums back.
// `cold`: nothing asked for these groups' weights ahead (a range's first chunk), so they are, kColdAheadBlocks
// blocks ahead of the work.
template <typename Fmt, bool kConstants>
void AmxWordGroupSums(const uint8_t* groups, int64_t count, int64_t blocks, int64_t m, const AmxCodeBytes& x,
                      const float* xd, const float* xs, bool cold, float* sums) {
  alignas(64) uint8_t split[kAmxChunkGroups][8 * 64];              // Q4: the weight tiles split from the nibbles
  alignas(64) int32_t block_sums[kAmxChunkGroups][2][kAmxBlockSumRows * 16];  // [group][tile of sums][rows, 16]
  for (int64_t i = 0; i < count * m; ++i) _mm512_storeu_ps(sums + i * 16, _mm512_setzero_ps());
  const bool one = m <= kAmxOneTileRows;
  const int64_t x_rows = AmxCodeRows(m), group_bytes = blocks * Fmt::kGroupBytes;
  constexpr int kLines = Fmt::kGroupBytes / 64;
  const uint8_t* tiles[kAmxChunkGroups];
  for (int64_t b = 0; cold && b < kColdAheadBlocks; ++b) {
    for (int64_t j = 0; j < count; ++j) {
      const char* block = reinterpret_cast<const char*>(groups + j * group_bytes + b * Fmt::kGroupBytes);
      for (int line = 0; line < kLines; ++line) _mm_prefetch(block + line * 64, _MM_HINT_T0);
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* block = groups + j * group_bytes + b * Fmt::kGroupBytes;
      if (cold) {  // past the group's last block: the next group's first blocks, read soon after
        const char* soon = reinterpret_cast<const char*>(block + kColdAheadBlocks * Fmt::kGroupBytes);
        for (int line = 0; line < kLines; ++line) _mm_prefetch(soon + line * 64, _MM_HINT_T0);
      }
      // the same block of the groups after these (the next call's), a whole pass over the blocks ahead: into L2,
      // since L1 would evict it before use
      const char* ahead = reinterpret_cast<const char*>(block + kAmxChunkGroups * group_bytes);
      for (int line = 0; line < kLines; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
      tiles[j] = block + Fmt::kCodesAt;
      if constexpr (!Fmt::kSigned) {
        const __m512i nibbles = _mm512_set1_epi8(0x0F);
        for (int t = 0; t < 4; ++t) {
          const __m512i word = _mm512_loadu_si512(tiles[j] + 64 * t);
          _mm512_store_si512(split[j] + 64 * t, _mm512_and_si512(word, nibbles));
          _mm512_store_si512(split[j] + 64 * (4 + t), _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles));
        }
        tiles[j] = split[j];
      }
    }
    const uint8_t* xb = x.bytes.data() + b * x_rows * 32;
    _tile_loadd(0, xb, 32);
    if (one) {
      for (int64_t j = 0; j < count; ++j) {
        switch (j & 3) {
          case 0: JVLLM_ONE_TILE_SUMS(2, 4, tiles[j], block_sums[j][0]); break;
          case 1: JVLLM_ONE_TILE_SUMS(3, 5, tiles[j], block_sums[j][0]); break;
          case 2: JVLLM_ONE_TILE_SUMS(2, 6, tiles[j], block_sums[j][0]); break;
          default: JVLLM_ONE_TILE_SUMS(3, 7, tiles[j], block_sums[j][0]); break;
        }
      }
    } else {
      _tile_loadd(1, xb + m * 32, 32);
      for (int64_t j = 0; j < count; ++j) {
        if (j & 1) {
          JVLLM_TWO_TILE_SUMS(3, 6, 7, tiles[j], block_sums[j][0], block_sums[j][1]);
        } else {
          JVLLM_TWO_TILE_SUMS(2, 4, 5, tiles[j], block_sums[j][0], block_sums[j][1]);
        }
      }
    }
    for (int64_t j = 0; j < count; ++j) {
      __m512 d, c;
      WordGroupScales<Fmt>(groups + j * group_bytes + b * Fmt::kGroupBytes, d, c);
      const int32_t* high = block_sums[j][0];
      const int32_t* low = one ? high + m * 16 : block_sums[j][1];
      // one tile: sum((h + 128) w) - 128 sum(w), the weights' sums from the row of ones
      const __m512i taken = one ? _mm512_slli_epi32(_mm512_load_si512(high + 2 * m * 16), 7) : _mm512_setzero_si512();
      for (int64_t r = 0; r < m; ++r) {
        const __m512i h = _mm512_sub_epi32(_mm512_load_si512(high + r * 16), taken);
        const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(h, 8), _mm512_load_si512(low + r * 16));
        AddBlockTerm<kConstants>(sums + (j * m + r) * 16, total, d, c, xd[r * blocks + b], xs[r * blocks + b]);
      }
    }
  }
}

#undef JVLLM_ONE_TILE_SUMS
#undef JVLLM_TWO_TILE_SUMS

}  // namespace jvllm

#endif  // JVLLM_AMX_INT8
