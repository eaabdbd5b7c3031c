// Products of many rows of x with GGUF weight rows dequantized into float tiles (quantized_products.h's path from
// 2 rows): the weights are unpacked once per tile and multiplied with float FMAs, so these paths are bound by the
// cores' float throughput, not by reading the weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "block_formats.h"
#include "line_aligned.h"
#include "transpose.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace jvllm {

// Weight rows stream from memory once per step, a few rows at a time: each block is fetched while the same block of
// the rows one group earlier is multiplied (the hardware prefetchers alone leave two thirds of the bandwidth unused).
// A prefetch past the end of the weights is harmless (it never faults).
inline void Prefetch(const uint8_t* p) {
#if defined(__SSE__)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

// Fetches a block (its cache lines) ahead of use.
template <typename Fmt>
void PrefetchBlock(const uint8_t* block) {
  for (int offset = 0; offset < Fmt::kBytes; offset += 64) Prefetch(block + offset);
}

inline V8 LoadV(const float* p) { return *reinterpret_cast<const V8Unaligned*>(p); }
inline void StoreV(float* p, V8 x) { *reinterpret_cast<V8Unaligned*>(p) = x; }

constexpr int kBlock = 32;  // weights per sub-block: the unit the kernels walk a row in

// f(std::integral_constant<int, rows>{}) for a run-time `rows` in [1, Max]: the tiled sweeps' last, smaller group of
// rows gets its own register-resident instance.
template <int Max, typename F>
inline void WithRowCount(int rows, F&& f) {
  if constexpr (Max > 0) {
    if (rows == Max) {
      f(std::integral_constant<int, Max>{});
    } else {
      WithRowCount<Max - 1>(rows, f);
    }
  }
}

// group(std::integral_constant<int, R>{}, m) over rows [m0, m1) of x in groups of R = kGroup rows, the last, smaller
// group with its own R (the tiled sweeps' row groups against one slice of weight tiles).
template <int kGroup, typename G>
inline void ForRowGroups(int64_t m0, int64_t m1, G&& group) {
  int64_t m = m0;
  for (; m + kGroup <= m1; m += kGroup) group(std::integral_constant<int, kGroup>{}, m);
  if (m < m1) WithRowCount<kGroup - 1>(static_cast<int>(m1 - m), [&](auto rows) { group(rows, m); });
}

// kTileRows weight rows at a time are dequantized into a float tile reused by every panel of kPanelRows
// rows of x (6 x 16: 12 accumulators, two x vectors and a broadcast weight fill AVX2's 16 registers).
constexpr int kTileRows = 6;
constexpr int kPanelRows = 16;
// From kBlockedMinRows rows of x (prefill) the weights are dequantized into tiles of kTileCols rows stored k-major
// instead, up to kChunkBytes of them per thread at a time (in L3), and x is swept in place kBlockRows rows and kDepth
// weights at a time (in L2), kGroupRows rows against a tile's slice (in L1): 6 x 16 again, with y's rows the
// accumulators, so no packing of x and no scattered writes of y (which cost 10-25% at 2,048 rows). Below, dequantizing
// and transposing a tile costs more than that saves.
constexpr int64_t kBlockedMinRows = 128;
constexpr int kTileCols = 16;
constexpr int kGroupRows = 6;
constexpr int64_t kDepth = 256;
constexpr int64_t kBlockRows = 128;
constexpr int64_t kChunkBytes = 1 << 20;

// The sweep of the tiled products that go two tiles at a time (bf16_tiles.h, int8_tiles.h) over output columns
// [n0, n1): chunks of `chunk` columns, whose tiles of kTileCols weight rows make(t, n, cols) builds (tile t of the
// chunk; gated, t and t + 1 are the gate and up tiles of the same columns), then x kBlockRows rows at a time, the
// depth `depth` units at a time (of `depth_total`), and the tiles two by two: pair(t, d0, d1, n, cols, m0, m1) for
// the pair from tile t, depth units [d0, d1), output columns [n, n + cols) and rows [m0, m1) of x's rows [m_begin,
// m_end). Rows go `block_rows` at a time (the AMX products take 32, the rows of two tiles of sums).
template <typename Make, typename Pair>
inline void SweepTilePairs(int64_t m_begin, int64_t m_end, int64_t n0, int64_t n1, int64_t chunk, bool gated,
                           int64_t depth_total, int64_t depth, Make&& make, Pair&& pair,
                           int64_t block_rows = kBlockRows) {
  const int64_t per_column_tile = gated ? 2 : 1;
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk), column_tiles = (c1 - c0 + kTileCols - 1) / kTileCols;
    for (int64_t t = 0; t < column_tiles; ++t) {
      const int64_t n = c0 + t * kTileCols;
      make(t * per_column_tile, n, static_cast<int>(std::min<int64_t>(kTileCols, c1 - n)));
    }
    const int64_t num_tiles = column_tiles * per_column_tile;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += block_rows) {
      const int64_t m1 = std::min(m_end, m0 + block_rows);
      for (int64_t d0 = 0; d0 < depth_total; d0 += depth) {
        const int64_t d1 = std::min(depth_total, d0 + depth);
        for (int64_t t = 0; t < num_tiles; t += 2) {
          const int64_t n = c0 + t / per_column_tile * kTileCols;
          const int64_t cols = gated ? kTileCols : t + 2 <= num_tiles ? 2 * kTileCols : kTileCols;
          pair(t, d0, d1, n, static_cast<int>(std::min<int64_t>(cols, c1 - n)), m0, m1);
        }
      }
    }
  }
}

// The same sweep for the tiled products that go one tile at a time (int16_tiles.h, int8_code_tiles.h): chunks of
// `chunk` columns of [n0, n1), whose tiles make(t, n, cols) builds, then x's rows [0, m) kBlockRows at a time, the
// depth `depth` units at a time (of `depth_total`), and each tile: tile(t, d0, d1, n, cols, m0, m1).
template <typename Make, typename Tile>
inline void SweepTiles(int64_t m, int64_t n0, int64_t n1, int64_t chunk, int64_t depth_total, int64_t depth,
                       Make&& make, Tile&& tile) {
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk), num_tiles = (c1 - c0 + kTileCols - 1) / kTileCols;
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t n = c0 + t * kTileCols;
      make(t, n, static_cast<int>(std::min<int64_t>(kTileCols, c1 - n)));
    }
    for (int64_t m0 = 0; m0 < m; m0 += kBlockRows) {
      const int64_t m1 = std::min(m, m0 + kBlockRows);
      for (int64_t d0 = 0; d0 < depth_total; d0 += depth) {
        const int64_t d1 = std::min(depth_total, d0 + depth);
        for (int64_t t = 0; t < num_tiles; ++t) {
          const int64_t n = c0 + t * kTileCols;
          tile(t, d0, d1, n, static_cast<int>(std::min<int64_t>(kTileCols, c1 - n)), m0, m1);
        }
      }
    }
  }
}

// x [M, K] -> panels [ceil(M / 16), K, 16]: panel p holds rows 16p.. k-major, padded with zero rows. Whole groups of
// 8 rows are moved by 8 x 8 transposes (~4.5x faster than element by element: this runs on the calling thread alone).
inline void PackPanels(const float* x, int64_t m, int64_t k, std::vector<float>& out) {
  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  out.resize(static_cast<size_t>(panels * k * kPanelRows));
  for (int64_t r0 = 0; r0 < panels * kPanelRows; r0 += kLanes) {
    float* dst = out.data() + (r0 / kPanelRows) * k * kPanelRows + r0 % kPanelRows;
    if (r0 + kLanes <= m) {
      for (int64_t c = 0; c < k; c += kLanes) Transpose8x8(x + r0 * k + c, k, dst + c * kPanelRows, kPanelRows);
      continue;
    }
    for (int64_t c = 0; c < k; ++c) {
      for (int64_t i = 0; i < kLanes; ++i) dst[c * kPanelRows + i] = r0 + i < m ? x[(r0 + i) * k + c] : 0.0f;
    }
  }
}

// y[M, N] = x[M, K] . W[N, K]^T for ranges of output rows (one thread's work item at a time).
template <typename Fmt>
class FloatTiles {
 public:
  // `panels`: x packed by PackPanels, for the panel path (fewer than kBlockedMinRows rows).
  FloatTiles(int64_t m, int64_t k, int64_t n, const float* x, const uint8_t* w, float* y, const float* panels)
      : m_(m), k_(k), n_(n), x_(x), w_(w), y_(y), panels_(panels) {}

  // Whether m rows of x take the panel path (x packed by PackPanels first) rather than the blocked one.
  static bool TakesPanels(int64_t m) { return m < kBlockedMinRows; }
  // Output rows per work item are a multiple of this (the blocked path takes whole tiles).
  static int64_t RowUnit(int64_t m) { return TakesPanels(m) ? 4 : kTileCols; }

  void Run(int64_t n0, int64_t n1) const {
    if (!TakesPanels(m_)) {
      Blocked(n0, n1);
    } else {
      Tiled(n0, n1);
    }
  }

 private:
  int64_t blocks_per_row() const { return k_ / Fmt::kWeights; }
  const uint8_t* Row(int64_t n) const { return w_ + n * blocks_per_row() * Fmt::kBytes; }

  // Weight row n -> dst [K] floats, while the blocks of row n + ahead are fetched. Inlined by force: as a call, GCC
  // compiled the panel path ~2.5x slower at 16-64 rows.
  __attribute__((always_inline)) void DequantizeRow(int64_t n, int64_t ahead, float* dst) const {
    const uint8_t* src = Row(n);
    for (int64_t block = 0; block < blocks_per_row(); ++block) {
      const uint8_t* w_block = src + block * Fmt::kBytes;
      PrefetchBlock<Fmt>(Row(n + ahead) + block * Fmt::kBytes);
      float d[Fmt::kSubs], c[Fmt::kSubs];
      Fmt::Scales(w_block, d, c);
#pragma GCC unroll 8
      for (int s = 0; s < Fmt::kSubs; ++s) {
        V8 w[kVecsPerSub];
        Fmt::Dequant(w_block, s, d[s], c[s], w);
        float* out = dst + (block * Fmt::kSubs + s) * kBlock;
        for (int v = 0; v < kVecsPerSub; ++v) StoreV(out + v * kLanes, w[v]);
      }
    }
  }

  // Every row of x against weight rows [n0, n1): kTileRows weight rows at a time are dequantized into a float tile
  // [kTileRows, K], then every panel of kPanelRows rows of x (packed k-major) is multiplied with it: per k, the
  // panel's two vectors of x times each tile row's weight broadcast (an outer product into 12 accumulators).
  void Tiled(int64_t n0, int64_t n1) const {
    thread_local std::vector<float> tile;
    GrowTo(tile, static_cast<size_t>(kTileRows) * k_);
    const int64_t panels = (m_ + kPanelRows - 1) / kPanelRows;
    for (int64_t n = n0; n < n1; n += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, n1 - n));
      for (int r = 0; r < rows; ++r) {
        DequantizeRow(n + r, kTileRows, tile.data() + r * k_);
      }
      for (int64_t p = 0; p < panels; ++p) {
        if (rows == kTileRows) {
          PanelTimesTile<kTileRows>(tile.data(), p, n);
        } else {
          for (int r = 0; r < rows; ++r) PanelTimesTile<1>(tile.data() + r * k_, p, n + r);
        }
      }
    }
  }

  template <int R>
  void PanelTimesTile(const float* tile, int64_t p, int64_t n) const {
    const int64_t k = k_;
    const float* panel = panels_ + p * k * kPanelRows;  // [K, kPanelRows]
    float out[R][kPanelRows];
#if defined(__AVX2__)
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; ++c) {
      const __m256 x0 = _mm256_loadu_ps(panel + c * kPanelRows), x1 = _mm256_loadu_ps(panel + c * kPanelRows + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(tile + r * k + c);
        acc[r][0] = _mm256_fmadd_ps(w, x0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, x1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out[r], acc[r][0]);
      _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
#else
    V8 acc[R][2] = {};
    for (int64_t c = 0; c < k; ++c) {
      const V8 x0 = LoadV(panel + c * kPanelRows), x1 = LoadV(panel + c * kPanelRows + kLanes);
      for (int r = 0; r < R; ++r) {
        const float w = tile[r * k + c];
        acc[r][0] += w * x0;
        acc[r][1] += w * x1;
      }
    }
    for (int r = 0; r < R; ++r) {
      StoreV(out[r], acc[r][0]);
      StoreV(out[r] + kLanes, acc[r][1]);
    }
#endif
    const int64_t m0 = p * kPanelRows, live = std::min<int64_t>(kPanelRows, m_ - m0);
    for (int r = 0; r < R; ++r) {
      for (int64_t i = 0; i < live; ++i) y_[(m0 + i) * n_ + n + r] = out[r][i];
    }
  }

  // Every row of x against weight rows [n0, n1), up to kChunkBytes of dequantized weights at a time: the rows are
  // dequantized into tiles of kTileCols rows stored k-major (TileWeights), then x is swept kBlockRows rows at a time,
  // and each of its depth slices (in L2) is multiplied with every tile's slice (in L1), kGroupRows rows of x at a
  // time; the block's part of y stays in L2 while its depth slices add to it.
  void Blocked(int64_t n0, int64_t n1) const {
    thread_local std::vector<float> tiles;
    const int64_t k = k_;
    const int64_t depth_blocks = (k + kDepth - 1) / kDepth;
    const int64_t depth = (k / Fmt::kWeights + depth_blocks - 1) / depth_blocks * Fmt::kWeights;
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (k * kTileCols * 4)) * kTileCols;
    GrowTo(tiles, static_cast<size_t>(std::min(chunk, n1 - n0 + kTileCols) * k));
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
      const int64_t c1 = std::min(n1, c0 + chunk), num_tiles = (c1 - c0 + kTileCols - 1) / kTileCols;
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t n = c0 + t * kTileCols;
        TileWeights(n, static_cast<int>(std::min<int64_t>(kTileCols, c1 - n)), tiles.data() + t * k * kTileCols);
      }
      for (int64_t m0 = 0; m0 < m_; m0 += kBlockRows) {
        const int64_t m1 = std::min(m_, m0 + kBlockRows);
        for (int64_t k0 = 0; k0 < k; k0 += depth) {
          const int64_t d = std::min(depth, k - k0);
          for (int64_t t = 0; t < num_tiles; ++t) {
            const int64_t n = c0 + t * kTileCols;
            const int cols = static_cast<int>(std::min<int64_t>(kTileCols, c1 - n));
            const float* tile = tiles.data() + (t * k + k0) * kTileCols;
            int64_t m = m0;
            for (; m + kGroupRows <= m1; m += kGroupRows) GroupTimesTile<kGroupRows>(tile, d, k0, m, n, cols);
            switch (m1 - m) {
              case 1: GroupTimesTile<1>(tile, d, k0, m, n, cols); break;
              case 2: GroupTimesTile<2>(tile, d, k0, m, n, cols); break;
              case 3: GroupTimesTile<3>(tile, d, k0, m, n, cols); break;
              case 4: GroupTimesTile<4>(tile, d, k0, m, n, cols); break;
              case 5: GroupTimesTile<5>(tile, d, k0, m, n, cols); break;
              default: break;
            }
          }
        }
      }
    }
  }

  // Weight rows [n, n + cols) -> tile [K, kTileCols] (row n + j in column j, zero columns past `cols`): each half
  // of 8 rows is dequantized into `rows`, then transposed 8 x 8 at a time.
  void TileWeights(int64_t n, int cols, float* tile) const {
    thread_local std::vector<float> rows;
    const int64_t k = k_;
    GrowTo(rows, static_cast<size_t>(kLanes * k));
    for (int half = 0; half < kTileCols / kLanes; ++half) {
      for (int r = 0; r < kLanes; ++r) {
        float* dst = rows.data() + r * k;
        const int64_t row = half * kLanes + r;
        if (row >= cols) {
          std::fill(dst, dst + k, 0.0f);
          continue;
        }
        DequantizeRow(n + row, kLanes, dst);
      }
      for (int64_t c = 0; c < k; c += kLanes) {
        Transpose8x8(rows.data() + c, k, tile + c * kTileCols + half * kLanes, kTileCols);
      }
    }
  }

  // Rows [m, m + R) of x, weights [k0, k0 + depth), times a tile -> y[m .. m + R, n .. n + cols), written by the
  // first depth block and added to by the others: per k, R broadcasts of x times the tile's two vectors.
  template <int R>
  void GroupTimesTile(const float* tile, int64_t depth, int64_t k0, int64_t m, int64_t n, int cols) const {
    const float* xr = x_ + m * k_ + k0;
    V8 acc[R][2] = {};
    for (int64_t c = 0; c < depth; ++c) {
      const V8 w0 = LoadV(tile + c * kTileCols), w1 = LoadV(tile + c * kTileCols + kLanes);
      for (int r = 0; r < R; ++r) {
        const float xv = xr[r * k_ + c];
        acc[r][0] += xv * w0;
        acc[r][1] += xv * w1;
      }
    }
    for (int r = 0; r < R; ++r) {
      float* yr = y_ + (m + r) * n_ + n;
      if (cols == kTileCols) {
        if (k0 > 0) {
          acc[r][0] += LoadV(yr);
          acc[r][1] += LoadV(yr + kLanes);
        }
        StoreV(yr, acc[r][0]);
        StoreV(yr + kLanes, acc[r][1]);
      } else {
        for (int j = 0; j < cols; ++j) {
          const float v = j < kLanes ? acc[r][0][j] : acc[r][1][j - kLanes];
          yr[j] = k0 > 0 ? yr[j] + v : v;
        }
      }
    }
  }

  int64_t m_, k_, n_;
  const float* x_;
  const uint8_t* w_;
  float* y_;
  const float* panels_;
};

}  // namespace jvllm
