// Products of many rows of x with GGUF weights through 16-bit integer dot products (AVX2 `vpmaddwd`: 16
// multiply-adds an instruction against a float FMA's 8): x is quantized to int16 per block of 32 (int16_dots.h),
// each weight row's codes are unpacked once per call into 16-bit tiles, and every row of x is multiplied with them.
// Each 32-weight sub-block's integer sum is scaled into float accumulators:
//   y[m, n] += d[n, s] * xd[m, s] * (codes[n, s] . xq[m, s]) + c[n, s] * xsum[m, s]
// so the result is the float32 product up to x's 15-bit rounding (the int16_dots.h precision).
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_formats.h"
#include "float_tiles.h"
#include "int16_dots.h"
#include "interleaved_blocks.h"
#include "line_aligned.h"
#include "transpose.h"

namespace jvllm {

// The largest x code for format Fmt: a sub-block's 32 products |code| * |x code| must sum within int32.
template <typename Fmt>
constexpr int32_t Int16Limit() {
  return static_cast<int32_t>(std::min<int64_t>(32767, 2147483647LL / (32LL * Fmt::kMaxCode)));
}

// y[M, N] = x[M, K] . W[N, K]^T for ranges of output rows, x given quantized (Int16Rows with Int16Limit<Fmt>()).
// The layout follows FloatTiles::Blocked: each thread unpacks up to kChunkBytes of its weight rows into tiles of
// kTileCols rows, then sweeps x kBlockRows rows and kIntDepth weights at a time, kRowGroup rows against a tile's
// slice.
template <typename Fmt>
class Int16Tiles {
 public:
  // A tile's depth slice: 16 columns x 1,024 weights x 2 bytes = 32 KB (L1; 256 and 512 measured 1-5% slower).
  static constexpr int64_t kIntDepth = 1024;
  static constexpr int kPairs = kBlock / 2;  // 16-bit pairs a sub-block

  Int16Tiles(int64_t m, int64_t k, int64_t n, const Int16Rows* xq, const uint8_t* w, float* y)
      : m_(m), k_(k), n_(n), subs_(k / kBlock), xq_(xq), w_(w), y_(y) {}

  void Run(int64_t n0, int64_t n1) const {
    thread_local std::vector<int16_t> codes;  // tiles [K / 2, kTileCols, 2] one after another
    thread_local std::vector<float> scales;   // per tile: d [subs, kTileCols], then c [subs, kTileCols]
    const int64_t k = k_;
    const int64_t slices = (k + kIntDepth - 1) / kIntDepth;
    const int64_t depth_subs = (subs_ + slices - 1) / slices;
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (k * kTileCols * 2)) * kTileCols;
    const int64_t most_tiles = (std::min(chunk, n1 - n0) + kTileCols - 1) / kTileCols;
    GrowTo(codes, static_cast<size_t>(most_tiles * k * kTileCols));
    GrowTo(scales, static_cast<size_t>(most_tiles * 2 * subs_ * kTileCols));
    auto make = [&](int64_t t, int64_t n, int cols) {
      TileCodes(n, cols, codes.data() + t * k * kTileCols, scales.data() + t * 2 * subs_ * kTileCols);
    };
    auto tile = [&](int64_t t, int64_t s0, int64_t s1, int64_t n, int cols, int64_t m0, int64_t m1) {
      const Slice slice{codes.data() + (t * k + s0 * kBlock) * kTileCols,
                        scales.data() + (t * 2 * subs_ + s0) * kTileCols,
                        scales.data() + ((t * 2 + 1) * subs_ + s0) * kTileCols, s0, s1 - s0, n, cols};
      ForRowGroups<kRowGroup>(m0, m1, [&](auto rows, int64_t m) { GroupTimesSlice<decltype(rows)::value>(slice, m); });
    };
    SweepTiles(m_, n0, n1, chunk, subs_, depth_subs, make, tile);
  }

 private:
  // Sub-blocks [s0, s0 + subs) of one tile: its codes, its d and c rows, which output columns.
  struct Slice {
    const int16_t* codes;  // [subs * kPairs, kTileCols, 2]
    const float* d;        // [subs, kTileCols]
    const float* c;        // [subs, kTileCols]
    int64_t s0, subs, n;
    int cols;
  };

  int64_t blocks_per_row() const { return k_ / Fmt::kWeights; }
  const uint8_t* Row(int64_t n) const { return w_ + n * blocks_per_row() * Fmt::kBytes; }

  // Weight rows [n, n + cols) -> codes [K / 2, kTileCols, 2] (row n + j's pair p at p * kTileCols + j, as one 32-bit
  // unit) and their scales (zero columns past `cols`): each half of 8 rows is unpacked into `rows` [8, K], then
  // its 32-bit pairs are transposed 8 x 8 at a time; interleaved weights unpack straight into the tile.
  void TileCodes(int64_t n, int cols, int16_t* codes, float* scales) const {
    if constexpr (kInterleavedRows<Fmt>) {
      InterleavedTileCodes<Fmt>(w_, k_, n, cols, codes, scales, scales + subs_ * kTileCols);
    } else {
      thread_local std::vector<int16_t> rows;
      const int64_t k = k_;
      GrowTo(rows, static_cast<size_t>(kLanes * k));
      float* d = scales;
      float* c = scales + subs_ * kTileCols;
      for (int half = 0; half < kTileCols / kLanes; ++half) {
        for (int r = 0; r < kLanes; ++r) {
          const int col = half * kLanes + r;
          int16_t* dst = rows.data() + r * k;
          if (col >= cols) {
            std::fill(dst, dst + k, int16_t{0});
            for (int64_t s = 0; s < subs_; ++s) d[s * kTileCols + col] = c[s * kTileCols + col] = 0.0f;
            continue;
          }
          const uint8_t* src = Row(n + col);
          for (int64_t block = 0; block < blocks_per_row(); ++block) {
            const uint8_t* w_block = src + block * Fmt::kBytes;
            PrefetchBlock<Fmt>(Row(n + col + kLanes) + block * Fmt::kBytes);
            float bd[Fmt::kSubs], bc[Fmt::kSubs];
            Fmt::Scales(w_block, bd, bc);
  #pragma GCC unroll 8
            for (int s = 0; s < Fmt::kSubs; ++s) {
              const int64_t sub = block * Fmt::kSubs + s;
              __m256i w0, w1;
              Fmt::Codes16(w_block, s, w0, w1);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + sub * kBlock), w0);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + sub * kBlock + 16), w1);
              d[sub * kTileCols + col] = bd[s];
              c[sub * kTileCols + col] = bc[s];
            }
          }
        }
        // the pairs as 32-bit units: an 8 x 8 float transpose moves their bits unchanged
        const float* src = reinterpret_cast<const float*>(rows.data());
        float* out = reinterpret_cast<float*>(codes);
        for (int64_t p = 0; p < k / 2; p += kLanes) {
          Transpose8x8(src + p, k / 2, out + p * kTileCols + half * kLanes, kTileCols);
        }
      }
    }
  }

  // Rows of x per register group: R int32 sums, R float sums, the tile's weight vector(s) and a broadcast pair of
  // x fill the registers (AVX-512: 12 x one 16-lane vector of its 32 registers; AVX2: 6 x two 8-lane vectors of 16).
#if JVLLM_INT16_512
  static constexpr int kRowGroup = 12;
#else
  static constexpr int kRowGroup = kGroupRows;
#endif


#if JVLLM_INT16_512
  // Rows [m, m + R) of x, the slice's sub-blocks, times the tile -> y[m .. m + R, n .. n + cols), written by the
  // first slice and added to by the others. A tile's pair p of all 16 columns is one 512-bit vector; per pair, R
  // broadcast pairs of x multiply it into int32 sums, and each sub-block's sums are scaled into float.
  template <int R>
  void GroupTimesSlice(const Slice& slice, int64_t m) const {
    const int64_t k = k_, subs_total = subs_;
    const int16_t* xq = xq_->q.data() + m * k + slice.s0 * kBlock;
    const float* xd = xq_->d.data() + m * subs_total + slice.s0;
    const float* xs = xq_->s.data() + m * subs_total + slice.s0;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < slice.subs; ++s) {
      const int16_t* tile = slice.codes + s * kPairs * kTileCols * 2;
      __m512i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int p = 0; p < kPairs; ++p) {
        const __m512i w = _mm512_loadu_si512(tile + p * kTileCols * 2);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, xq + r * k + s * kBlock + 2 * p, 4);
          sums[r] = AddPairProducts(sums[r], w, _mm512_set1_epi32(pair));
          KeepInRegister(sums[r]);  // running sums, as in the AVX2 loop below
        }
      }
      const __m512 d = _mm512_loadu_ps(slice.d + s * kTileCols);
      const __m512 c = _mm512_loadu_ps(slice.c + s * kTileCols);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * subs_total + s])),
                                 acc[r]);
        acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(xs[r * subs_total + s]), acc[r]);
      }
    }
    const __mmask16 live = static_cast<__mmask16>((1u << slice.cols) - 1u);
    for (int r = 0; r < R; ++r) {
      float* yr = y_ + (m + r) * n_ + slice.n;
      const __m512 out = slice.s0 == 0 ? acc[r] : _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(live, yr));
      _mm512_mask_storeu_ps(yr, live, out);
    }
  }
#else
  // Rows [m, m + R) of x, the slice's sub-blocks, times the tile -> y[m .. m + R, n .. n + cols), written by the
  // first slice and added to by the others. Per sub-block: per pair of weights, R broadcast pairs of x against the
  // tile's two vectors into int32 sums, then each sum scaled into float. (6 rows x 2 vectors measured fastest:
  // 6 x 1, 8 x 1, 10 x 1, 12 x 1 and 4 x 2 ran 4-30% slower at 2,048 rows.)
  template <int R>
  void GroupTimesSlice(const Slice& slice, int64_t m) const {
    constexpr int V = kTileCols / kLanes;
    const int64_t k = k_, subs_total = subs_;
    const int16_t* xq = xq_->q.data() + m * k + slice.s0 * kBlock;
    const float* xd = xq_->d.data() + m * subs_total + slice.s0;
    const float* xs = xq_->s.data() + m * subs_total + slice.s0;
    V8 acc[R][V] = {};
    for (int64_t s = 0; s < slice.subs; ++s) {
      const int16_t* tile = slice.codes + s * kPairs * kTileCols * 2;
      __m256i sums[R][V];
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < V; ++v) sums[r][v] = _mm256_setzero_si256();
      }
#pragma GCC unroll 16
      for (int p = 0; p < kPairs; ++p) {
        __m256i w[V];
        for (int v = 0; v < V; ++v) {
          w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + p * kTileCols * 2 + v * 2 * kLanes));
        }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, xq + r * k + s * kBlock + 2 * p, 4);
          const __m256i xb = _mm256_set1_epi32(pair);
          for (int v = 0; v < V; ++v) {
            sums[r][v] = AddPairProducts(sums[r][v], w[v], xb);
            // kept in registers as running sums: otherwise GCC reassociates the unrolled loop into a tree of
            // sums with the products spilled to the stack (~2x slower)
            KeepInRegister(sums[r][v]);
          }
        }
      }
      for (int v = 0; v < V; ++v) {
        const V8 d = LoadV(slice.d + s * kTileCols + v * kLanes);
        const V8 c = LoadV(slice.c + s * kTileCols + v * kLanes);
        for (int r = 0; r < R; ++r) {
          acc[r][v] += (V8)_mm256_cvtepi32_ps(sums[r][v]) * (d * xd[r * subs_total + s]);
          acc[r][v] += c * xs[r * subs_total + s];
        }
      }
    }
    const bool first = slice.s0 == 0;
    for (int r = 0; r < R; ++r) {
      float* yr = y_ + (m + r) * n_ + slice.n;
      for (int v = 0; v < V; ++v) {
        const int live = std::min(kLanes, slice.cols - v * kLanes);
        if (live == kLanes) {
          StoreV(yr + v * kLanes, first ? acc[r][v] : acc[r][v] + LoadV(yr + v * kLanes));
        } else {
          for (int j = 0; j < live; ++j) yr[v * kLanes + j] = first ? acc[r][v][j] : yr[v * kLanes + j] + acc[r][v][j];
        }
      }
    }
  }

#endif  // AVX-512

  int64_t m_, k_, n_, subs_;
  const Int16Rows* xq_;
  const uint8_t* w_;
  float* y_;
};

}  // namespace jvllm

#endif  // __AVX2__
