// 8-bit products of many rows of x with Q4_0 / Q4_1 weights interleaved by groups of 8 rows (interleaved_blocks.h),
// for AVX2 builds on request (batched_weight_dtype="int8", as int8_tiles.h does with AVX-512 VNNI): x is quantized
// per block of 32 to int8 (scale max |x| / 127, each block's exact sum kept for the weights' block constants), and
// `vpmaddubsw` multiplies 32 unsigned 4-bit codes with 32 signed 8-bit activations into 16 int16 pair sums, twice
// the multiply-adds of the int16 tiles' `vpmaddwd`. A block's 8 such sums per lane stay within int16 (8 x 2 x 15 x
// 127 = 30,480), so they are added with `vpaddw` and widened once per block by a `vpmaddwd` against ones; then
//   y[m, n] += d[n, b] * xd[m, b] * isum + c[n, b] * xsum[m, b]
// as the int16 tiles scale theirs. Precision: each product within half a step of x's block scale times the block's
// sum |d q| (int8_tiles.h; docs/design/gguf_blocks.md says why this is not the default).
//
// The order of a block's 32 products does not matter to an exact integer sum, so a tile lane holds what one 16-bit
// word of an interleaved chunk gives: row j's code bytes 2p and 2p + 1, low nibbles then high nibbles (weights 2p,
// 2p + 1, 16 + 2p, 17 + 2p), and x's codes are stored in that order once per call.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "block_formats.h"
#include "float_tiles.h"
#include "int16_dots.h"
#include "int8_blocks.h"
#include "interleaved_blocks.h"
#include "line_aligned.h"
#include "run_items.h"

namespace jvllm {

template <typename Fmt>
constexpr bool kInt8CodeTiles = std::is_same_v<Fmt, Q4_0x8> || std::is_same_v<Fmt, Q4_1x8>;
// From this many rows of x when 8-bit products are asked for: from there the tiles are faster than the int16 row
// chunks (docs/design/gguf_blocks.md), and up to 8 rows the int16 row path gives each row its own bits (batch
// invariance).
constexpr int64_t kInt8CodeTileMinRows = 9;

// x [M, K] quantized per block of 32 to int8 codes in the tiles' weight order (quad p: weights 2p, 2p + 1, 16 + 2p,
// 17 + 2p), with each block's scale and exact sum.
struct Int8QuadRows : Int8Blocks {
  void Quantize(const float* x, int64_t m, int64_t k) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    // after the packs, 4-byte groups hold weights 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31: put 0-7 and
    // 16-23 in the low lane, 8-15 and 24-31 in the high one, then each lane's quads (2q, 2q + 1, 8 + 2q, 9 + 2q)
    const __m256i lanes = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
    const __m256i quads = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                           0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    QuantizeBlocks(m, k, [&](int64_t b) {
      const float* src = x + b * 32;
      __m256 v[4];
      __m256 most = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        most = _mm256_max_ps(most, _mm256_andnot_ps(sign, v[i]));
        sum = _mm256_add_ps(sum, v[i]);
      }
      const float max_abs = HorizontalMax(most);
      const __m256 inverse = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
      __m256i ints[4];
      for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                                _mm256_packs_epi32(ints[2], ints[3]));
      const __m256i ordered = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(packed, lanes), quads);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes.data() + b * 32), ordered);
      scales[b] = max_abs / 127.0f;
      sums[b] = HorizontalSum(sum);
    });
  }

 private:
  static float HorizontalMax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float HorizontalSum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};

// y[M, N] = x[M, K] . W[N, K]^T for ranges of output columns, x given as Int8QuadRows. The layout follows
// Int16Tiles: each thread unpacks up to kChunkBytes of its weight groups into tiles of kTileCols columns, then sweeps
// x kBlockRows rows and kDepthBlocks blocks at a time, kRowGroup rows against a tile's slice.
template <typename Fmt>
class Int8CodeTiles {
 public:
  static constexpr int64_t kDepthBlocks = 32;  // a tile's depth slice: 32 blocks x 512 bytes of codes = 16 KB (L1)
  static constexpr int kRowGroup = 6;          // 6 rows x 2 vectors: 12 int16 sums, two tile vectors, one broadcast
  static constexpr int kQuads = 8;             // 4-byte quads of codes a block
  static constexpr int kHalves = kTileCols / Fmt::kRows;

  Int8CodeTiles(int64_t m, int64_t k, int64_t n, const Int8QuadRows* xq, const uint8_t* w, float* y)
      : m_(m), k_(k), n_(n), blocks_(k / 32), xq_(xq), w_(w), y_(y) {}

  void Run(int64_t n0, int64_t n1) const {
    thread_local std::vector<uint32_t> codes;  // per tile: [blocks, kQuads, kTileCols] code quads
    thread_local std::vector<float> scales;    // per tile: d [blocks, kTileCols], then c [blocks, kTileCols]
    const int64_t tile_words = blocks_ * kQuads * kTileCols, tile_scales = 2 * blocks_ * kTileCols;
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (tile_words * 4)) * kTileCols;
    const int64_t most_tiles = (std::min(chunk, n1 - n0) + kTileCols - 1) / kTileCols;
    GrowTo(codes, static_cast<size_t>(most_tiles * tile_words));
    GrowTo(scales, static_cast<size_t>(most_tiles * tile_scales));
    auto make = [&](int64_t t, int64_t n, int cols) {
      TileCodes(n, cols, codes.data() + t * tile_words, scales.data() + t * tile_scales);
    };
    auto tile = [&](int64_t t, int64_t b0, int64_t b1, int64_t n, int cols, int64_t m0, int64_t m1) {
      const float* tile_scale = scales.data() + t * tile_scales;
      const Slice slice{codes.data() + t * tile_words, tile_scale, tile_scale + blocks_ * kTileCols, b0, b1, n, cols};
      ForRowGroups<kRowGroup>(m0, m1, [&](auto rows, int64_t m) { GroupTimesSlice<decltype(rows)::value>(slice, m); });
    };
    SweepTiles(m_, n0, n1, chunk, blocks_, kDepthBlocks, make, tile);
  }

 private:
  // Blocks [b0, b1) of one tile: its code quads, d and c (whole tile, indexed by block), which output columns.
  struct Slice {
    const uint32_t* codes;  // [blocks, kQuads, kTileCols]
    const float* d;         // [blocks, kTileCols]
    const float* c;         // [blocks, kTileCols]
    int64_t b0, b1, n;
    int cols;
  };

  // Groups n / 8 and n / 8 + 1 (the second zero past `cols`) -> code quads and scales: lane j of quad p is row j's
  // chunk-p word widened to 32 bits, its low nibbles in bytes 0-1 and its high nibbles in bytes 2-3.
  void TileCodes(int64_t n, int cols, uint32_t* codes, float* scales) const {
    float* d = scales;
    float* c = scales + blocks_ * kTileCols;
    const __m256i nibbles = _mm256_set1_epi16(0x0F0F);
    for (int half = 0; half < kHalves; ++half) {
      const int col0 = half * Fmt::kRows;
      const bool live = col0 < cols;
      const uint8_t* group = w_ + (n + col0) / Fmt::kRows * blocks_ * Fmt::kGroupBytes;
      for (int64_t b = 0; b < blocks_; ++b) {
        uint32_t* out = codes + b * kQuads * kTileCols + col0;
        if (!live) {
          for (int p = 0; p < kQuads; ++p) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p * kTileCols),
                                                               _mm256_setzero_si256());
          _mm256_storeu_ps(d + b * kTileCols + col0, _mm256_setzero_ps());
          _mm256_storeu_ps(c + b * kTileCols + col0, _mm256_setzero_ps());
          continue;
        }
        const uint8_t* block = group + b * Fmt::kGroupBytes;
        __m256 bd, bc;
        GroupScales<Fmt>(block, bd, bc);
        _mm256_storeu_ps(d + b * kTileCols + col0, bd);
        _mm256_storeu_ps(c + b * kTileCols + col0, bc);
        for (int p = 0; p < kQuads; ++p) {
          const __m256i words = _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + Fmt::kCodesAt + 16 * p)));
          const __m256i low = _mm256_and_si256(words, nibbles);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(words, 4), nibbles);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p * kTileCols),
                              _mm256_or_si256(low, _mm256_slli_epi32(high, 16)));
        }
      }
    }
  }

  // Rows [m, m + R) of x, the slice's blocks, times the tile -> y[m .. m + R, n .. n + cols), written by the first
  // slice and added to by the others.
  template <int R>
  void GroupTimesSlice(const Slice& slice, int64_t m) const {
    const int64_t k = k_, blocks = blocks_;
    const int8_t* xq = xq_->codes.data() + m * k;
    const float* xd = xq_->scales.data() + m * blocks;
    const float* xs = xq_->sums.data() + m * blocks;
    const __m256i ones = _mm256_set1_epi16(1);
    V8 acc[R][kHalves] = {};
    for (int64_t b = slice.b0; b < slice.b1; ++b) {
      const uint32_t* tile = slice.codes + b * kQuads * kTileCols;
      __m256i sums[R][kHalves];
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < kHalves; ++v) sums[r][v] = _mm256_setzero_si256();
      }
#pragma GCC unroll 8
      for (int p = 0; p < kQuads; ++p) {
        __m256i w[kHalves];
        for (int v = 0; v < kHalves; ++v) {
          w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + p * kTileCols + v * kLanes));
        }
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, xq + r * k + b * 32 + 4 * p, 4);
          const __m256i xb = _mm256_set1_epi32(quad);
          for (int v = 0; v < kHalves; ++v) {
            sums[r][v] = _mm256_add_epi16(sums[r][v], _mm256_maddubs_epi16(w[v], xb));
            KeepInRegister(sums[r][v]);  // running sums (int16_tiles.h says why)
          }
        }
      }
      for (int v = 0; v < kHalves; ++v) {
        const V8 d = LoadV(slice.d + b * kTileCols + v * kLanes);
        const V8 c = LoadV(slice.c + b * kTileCols + v * kLanes);
        for (int r = 0; r < R; ++r) {
          const V8 total = (V8)_mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][v], ones));
          acc[r][v] += total * (d * xd[r * blocks + b]);
          acc[r][v] += c * xs[r * blocks + b];
        }
      }
    }
    const bool first = slice.b0 == 0;
    for (int r = 0; r < R; ++r) {
      float* yr = y_ + (m + r) * n_ + slice.n;
      for (int v = 0; v < kHalves; ++v) {
        if (v * kLanes >= slice.cols) break;  // cols is a multiple of the groups' 8 rows
        StoreV(yr + v * kLanes, first ? acc[r][v] : acc[r][v] + LoadV(yr + v * kLanes));
      }
    }
  }

  int64_t m_, k_, n_, blocks_;
  const Int8QuadRows* xq_;
  const uint8_t* w_;
  float* y_;
};

// y[M, N] = x[M, K] . W[N, K]^T for interleaved Q4_0 / Q4_1 W through 8-bit code tiles.
template <typename Fmt>
void RunInt8CodeTiles(int64_t m, int64_t k, int64_t n, const float* x, const uint8_t* w, float* y) {
  thread_local Int8QuadRows xq;
  xq.Quantize(x, m, k);
  RunColumnItems(Int8CodeTiles<Fmt>(m, k, n, &xq, w, y), n, kTileCols);
}

}  // namespace jvllm

#endif  // __AVX2__
