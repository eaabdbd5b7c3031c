// 8-bit integer products with 4- and 5-bit GGUF blocks (Q4_0, Q4_1, Q4_K, Q5_K) for steps of many rows, on CPUs
// with AVX-512 VNNI:
// `vpdpbusd` multiplies 64 unsigned 8-bit codes with 64 signed 8-bit activations into 16 int32 sums an instruction,
// twice the multiply-adds of a `vdpbf16ps`. x is quantized per block of 32 (one scale each, as llama.cpp's Q8
// activations); each 32-weight (sub-)block's int32 sums are scaled into float32 by its scale times x's, and its
// constant (Q4_1's minimum, Q4_0's -8 d, a K-quant's -dmin m) meets x's exact sum over the block. Precision: each
// product is within half a step of x's block scale (max |x| / 254) times sum |d q| of the block, several times
// bfloat16's rounding (docs/design/gguf_blocks.md: why it is not the default).
#pragma once

#include <cstdint>
#include <type_traits>

#include "block_formats.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define JVLLM_INT8_TILES 1
#else
#define JVLLM_INT8_TILES 0
#endif

namespace jvllm {

template <typename Fmt>
constexpr bool kInt8Tiles = JVLLM_INT8_TILES && (std::is_same_v<Fmt, Q4_0> || std::is_same_v<Fmt, Q4_1> ||
                                                  std::is_same_v<Fmt, Q4_K> || std::is_same_v<Fmt, Q5_K> ||
                                                  std::is_same_v<Fmt, Q4_0x16> || std::is_same_v<Fmt, Q4_1x16>);

// Whether a product of `m` rows takes the 8-bit tiles: the build has them, the format is a 4-bit one and the rows
// are at least the caller's limit (0: never).
template <typename Fmt>
constexpr bool TakesInt8Tiles(int64_t m, int64_t min_rows) {
  return kInt8Tiles<Fmt> && min_rows > 0 && m >= min_rows;
}

}  // namespace jvllm

#if JVLLM_INT8_TILES
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "block_formats.h"
#include "float_tiles.h"
#include "int8_blocks.h"
#include "line_aligned.h"
#include "run_items.h"
#include "vector_exp.h"
#include "word_group_blocks.h"

namespace jvllm {

// x [M, K] quantized per block of 32 to int8 codes with scale max |x| / 127, and each block's exact sum (for the
// weights' block constants).
struct Int8Rows : Int8Blocks {
  void Quantize(const float* x, int64_t m, int64_t k) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    QuantizeBlocks(m, k, [&](int64_t b) {
      const __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
      const float most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
      const float scale = most / 127.0f;
      const __m512 inverse = _mm512_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
      const __m128i qlo = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse)));
      const __m128i qhi = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes.data() + b * 32), qlo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes.data() + b * 32 + 16), qhi);
      scales[b] = scale;
      sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    });
  }
};

// y[M, N] = x[M, K] . W[N, K]^T for ranges of output rows, with 8-bit products. Each thread unpacks up to
// kChunkBytes of its weight rows into tiles of kTileCols rows: per block, 8 vectors of the 16 rows' codes as
// unsigned bytes, four consecutive weights of a row in one 32-bit lane, and the rows' block scales and constants
// as float vectors. x is swept kBlockRows rows and kDepthBlocks blocks at a time, kRowGroup rows against two tiles:
// 12 int32 sums per block, scaled into 12 float accumulators.
//
// Gated (`up` given): output column n is silu(x . gate_n) * (x . up_n), the two tiles of each step a gate tile and
// the up tile of the same 16 columns, summed over the whole depth at once.
template <typename Fmt>
class Int8Tiles {
 public:
  static constexpr int64_t kDepthBlocks = 32;  // a tile's depth slice: 32 blocks x 8 x 64 bytes = 16 KB (L1)
  static constexpr int kRowGroup = 6;

  Int8Tiles(int64_t m, int64_t k, int64_t n, const Int8Rows* xq, const uint8_t* w, float* y,
            const uint8_t* up = nullptr)
      : m_(m), k_(k), n_(n), xq_(xq), w_(w), up_(up), y_(y) {}

  int64_t ColumnsPerTilePair() const { return up_ == nullptr ? 2 * kTileCols : kTileCols; }

  void Run(int64_t n0, int64_t n1) const {
    thread_local std::vector<uint32_t> tiles;  // per tile: codes [K / 4, 16], then scales and constants [K / 32, 16]
    const int64_t tile_words = TileWords();
    const int64_t per_column_tile = up_ == nullptr ? 1 : 2;
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (tile_words * 4 * per_column_tile)) * ColumnsPerTilePair();
    const int64_t most_tiles = (std::min(chunk, n1 - n0) + kTileCols - 1) / kTileCols * per_column_tile;
    const int64_t blocks = k_ / 32, depth = up_ == nullptr ? kDepthBlocks : blocks;
    GrowTo(tiles, static_cast<size_t>(most_tiles * tile_words));
    auto make = [&](int64_t t, int64_t n, int cols) {
      uint32_t* tile = tiles.data() + t * tile_words;
      TileCodes(w_, n, cols, tile);
      if (up_ != nullptr) TileCodes(up_, n, cols, tile + tile_words);
    };
    auto pair = [&](int64_t t, int64_t b0, int64_t b1, int64_t n, int cols, int64_t m0, int64_t m1) {
      const Slice slice{tiles.data() + t * tile_words, b0, b1, n, cols};
      ForRowGroups<kRowGroup>(m0, m1, [&](auto rows, int64_t m) { GroupTimesSlice<decltype(rows)::value>(slice, m); });
    };
    SweepTilePairs(0, m_, n0, n1, chunk, up_ != nullptr, blocks, depth, make, pair);
  }

 private:
  // Blocks [b0, b1) of one or two adjacent tiles (`cols` output columns from n: up to 32).
  struct Slice {
    const uint32_t* tiles;  // the first tile; the second follows it
    int64_t b0, b1, n;
    int cols;
  };

  int64_t TileWords() const { return k_ / 4 * kTileCols + 2 * (k_ / 32) * kTileCols; }
  static const float* Scales(const uint32_t* tile, int64_t k) {
    return reinterpret_cast<const float*>(tile + k / 4 * kTileCols);
  }

  // Weight rows [n, n + cols) -> a tile (zero codes and scales in the columns past `cols`). A block's 16 code bytes
  // hold weights i (low nibble of byte i) and 16 + i (high nibble): word t of a row gives, masked, the quad of
  // weights 4t .. 4t + 3 and, shifted, that of 16 + 4t .. 19 + 4t, so the quads come in the weights' own order.
  void TileCodes(const uint8_t* w, int64_t n, int cols, uint32_t* tile) const {
    if constexpr (kWordGroups<Fmt>) {
      TileCodesWordGroups(w, n, tile);
    } else if constexpr (Fmt::kWeights == 32) {
      TileCodes32(w, n, cols, tile);
    } else {
      TileCodesK(w, n, cols, tile);
    }
  }

  // Q4_0 / Q4_1 grouped by code words (word_group_blocks.h; whole groups of 16 rows): word t of the 16 rows is one
  // load, its bytes put back in each row's order (4t .. 4t + 3) by one shuffle; the scales are loaded as they lie.
  void TileCodesWordGroups(const uint8_t* w, int64_t n, uint32_t* tile) const {
    const int64_t blocks = k_ / 32;
    const uint8_t* group = w + n / Fmt::kRows * blocks * Fmt::kGroupBytes;
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512i row_order =  // each 32-bit lane's stored bytes 0, 2, 1, 3 -> 0, 1, 2, 3 (indices within 128 bits)
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
    float* scales = const_cast<float*>(Scales(tile, k_));
    float* constants = scales + blocks * kTileCols;
    for (int64_t block = 0; block < blocks; ++block) {
      const uint8_t* at = group + block * Fmt::kGroupBytes;
      const char* ahead = reinterpret_cast<const char*>(at + 4 * Fmt::kGroupBytes);
      for (int line = 0; line < Fmt::kGroupBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      __m512 d, c;
      WordGroupScales<Fmt>(at, d, c);
      _mm512_storeu_ps(scales + block * kTileCols, d);
      _mm512_storeu_ps(constants + block * kTileCols, c);
      uint32_t* quads = tile + block * 8 * kTileCols;
      for (int t = 0; t < 4; ++t) {
        const __m512i word = _mm512_shuffle_epi8(_mm512_loadu_si512(at + Fmt::kCodesAt + 64 * t), row_order);
        _mm512_storeu_si512(quads + t * kTileCols, _mm512_and_si512(word, nibbles));
        _mm512_storeu_si512(quads + (4 + t) * kTileCols, _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles));
      }
    }
  }

  void TileCodes32(const uint8_t* w, int64_t n, int cols, uint32_t* tile) const {
    constexpr int64_t kHeader = Fmt::kBytes - 16;
    const int64_t row_bytes = k_ / 32 * Fmt::kBytes;
    const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
    const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    float* scales = const_cast<float*>(Scales(tile, k_));
    float* constants = scales + k_ / 32 * kTileCols;
    const uint8_t* first = w + n * row_bytes;
    for (int64_t block = 0; block < k_ / 32; ++block) {
      const uint8_t* at = first + block * Fmt::kBytes;
      const uint8_t* next_tile = at + 16 * row_bytes;
      for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(next_tile + r * row_bytes), _MM_HINT_T0);
      const __m512i header = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row_at, at, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header));
      const __m512 c = std::is_same_v<Fmt, Q4_1>
                           ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header, 16)))
                           : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
      _mm512_storeu_ps(scales + block * kTileCols, d);
      _mm512_storeu_ps(constants + block * kTileCols, c);
      uint32_t* quads = tile + block * 8 * kTileCols;
      for (int t = 0; t < 4; ++t) {
        const __m512i word = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row_at, at + kHeader + 4 * t, 1);
        _mm512_storeu_si512(quads + t * kTileCols, _mm512_and_si512(word, nibbles));
        _mm512_storeu_si512(quads + (4 + t) * kTileCols, _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles));
      }
    }
  }

  // Q4_K and Q5_K (256-weight blocks of 8 sub-blocks): sub-block s takes the low (s even) or high nibbles of bytes
  // 32 (s / 2) .. + 31 of qs, word t of them giving weights 4t .. 4t + 3; Q5_K adds bit s of qh's word t as 16 each.
  // Each row's sub-block scales and constants are decoded as the other paths decode them (Fmt::Scales).
  void TileCodesK(const uint8_t* w, int64_t n, int cols, uint32_t* tile) const {
    const int64_t row_bytes = k_ / Fmt::kWeights * Fmt::kBytes, subs = k_ / 32;
    const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
    const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F), ones = _mm512_set1_epi32(0x01010101);
    float* scales = const_cast<float*>(Scales(tile, k_));
    float* constants = scales + subs * kTileCols;
    const uint8_t* first = w + n * row_bytes;
    for (int64_t block = 0; block < k_ / Fmt::kWeights; ++block) {
      const uint8_t* at = first + block * Fmt::kBytes;
      for (int r = 0; r < kTileCols; ++r) {
        float d[Fmt::kSubs] = {}, c[Fmt::kSubs] = {};
        if (r < cols) Fmt::Scales(at + r * row_bytes, d, c);
        for (int s = 0; s < Fmt::kSubs; ++s) {
          scales[(block * Fmt::kSubs + s) * kTileCols + r] = d[s];
          constants[(block * Fmt::kSubs + s) * kTileCols + r] = c[s];
        }
      }
      __m512i high[8];  // Q5_K: qh's words
      if constexpr (Fmt::kMaxCode > 15) {
        for (int t = 0; t < 8; ++t) {
          high[t] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row_at, at + 16 + 4 * t, 1);
        }
      }
      for (int pair = 0; pair < Fmt::kSubs / 2; ++pair) {
        uint32_t* even = tile + (block * Fmt::kSubs + 2 * pair) * 8 * kTileCols;
        uint32_t* odd = even + 8 * kTileCols;
        for (int t = 0; t < 8; ++t) {
          const __m512i word = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row_at,
                                                           at + Fmt::kQs + 32 * pair + 4 * t, 1);
          __m512i low = _mm512_and_si512(word, nibbles), top = _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles);
          if constexpr (Fmt::kMaxCode > 15) {
            const __m512i bits_even = _mm512_and_si512(_mm512_srli_epi32(high[t], 2 * pair), ones);
            const __m512i bits_odd = _mm512_and_si512(_mm512_srli_epi32(high[t], 2 * pair + 1), ones);
            low = _mm512_or_si512(low, _mm512_slli_epi32(bits_even, 4));
            top = _mm512_or_si512(top, _mm512_slli_epi32(bits_odd, 4));
          }
          _mm512_storeu_si512(even + t * kTileCols, low);
          _mm512_storeu_si512(odd + t * kTileCols, top);
        }
      }
    }
  }

  // Rows [m, m + R) of x times the slice -> y[m .. m + R, n .. n + cols), written by the first depth slice and added
  // to by the others.
  template <int R>
  void GroupTimesSlice(const Slice& slice, int64_t m) const {
    if (slice.cols > kTileCols || up_ != nullptr) {
      GroupTimesTiles<R, true>(slice, m);
    } else {
      GroupTimesTiles<R, false>(slice, m);
    }
  }

  // The group against one tile or two (kTwo): per block, 8 code vectors of each tile, and per row a broadcast quad
  // of x into each tile's int32 sums; then each sum scaled into its float accumulator.
  template <int R, bool kTwo>
  void GroupTimesTiles(const Slice& slice, int64_t m) const {
    const int64_t quads_per_row = k_ / 4, blocks = k_ / 32;
    const int32_t* x = reinterpret_cast<const int32_t*>(xq_->codes.data()) + m * quads_per_row;
    const float* xs = xq_->scales.data() + m * blocks;
    const float* xsum = xq_->sums.data() + m * blocks;
    const uint32_t* t0 = slice.tiles;
    const uint32_t* t1 = slice.tiles + TileWords();  // read only with kTwo
    const float* d0 = Scales(t0, k_);
    const float* d1 = Scales(t1, k_);
    const float* c0 = d0 + blocks * kTileCols;
    const float* c1 = d1 + blocks * kTileCols;
    __m512 f0[R], f1[R];
    for (int r = 0; r < R; ++r) f0[r] = f1[r] = _mm512_setzero_ps();
    for (int64_t b = slice.b0; b < slice.b1; ++b) {
      __m512i i0[R], i1[R];
      for (int r = 0; r < R; ++r) i0[r] = i1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const int64_t q = b * 8 + j;
        const __m512i w0 = _mm512_loadu_si512(t0 + q * kTileCols);
        const __m512i w1 = kTwo ? _mm512_loadu_si512(t1 + q * kTileCols) : w0;
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          const __m512i xr = _mm512_set1_epi32(x[r * quads_per_row + q]);
          i0[r] = _mm512_dpbusd_epi32(i0[r], w0, xr);
          if (kTwo) i1[r] = _mm512_dpbusd_epi32(i1[r], w1, xr);
        }
      }
      const __m512 vd0 = _mm512_loadu_ps(d0 + b * kTileCols), vc0 = _mm512_loadu_ps(c0 + b * kTileCols);
      const __m512 vd1 = kTwo ? _mm512_loadu_ps(d1 + b * kTileCols) : vd0;
      const __m512 vc1 = kTwo ? _mm512_loadu_ps(c1 + b * kTileCols) : vc0;
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(xs[r * blocks + b]), sum = _mm512_set1_ps(xsum[r * blocks + b]);
        f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), _mm512_mul_ps(vd0, s), _mm512_fmadd_ps(vc0, sum, f0[r]));
        if (kTwo) {
          f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), _mm512_mul_ps(vd1, s), _mm512_fmadd_ps(vc1, sum, f1[r]));
        }
      }
    }
    const int cols1 = std::max(0, slice.cols - kTileCols);
    const __mmask16 live0 = static_cast<__mmask16>((1u << std::min(slice.cols, kTileCols)) - 1u);
    const __mmask16 live1 = static_cast<__mmask16>((1u << cols1) - 1u);
    if (up_ != nullptr) {  // f0: gate sums, f1: up sums of the same columns
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y_ + (m + r) * n_ + slice.n, live0, Silu512(f0[r]) * f1[r]);
      return;
    }
    const bool first = slice.b0 == 0;
    for (int r = 0; r < R; ++r) {
      float* yr = y_ + (m + r) * n_ + slice.n;
      Store(yr, live0, f0[r], first);
      if (kTwo && cols1 > 0) Store(yr + kTileCols, live1, f1[r], first);
    }
  }

  static void Store(float* y, __mmask16 live, __m512 sums, bool first) {
    _mm512_mask_storeu_ps(y, live, first ? sums : _mm512_add_ps(sums, _mm512_maskz_loadu_ps(live, y)));
  }

  int64_t m_, k_, n_;
  const Int8Rows* xq_;
  const uint8_t* w_;
  const uint8_t* up_;  // gated: the up weights (w_ then holds the gate's)
  float* y_;
};

// y[M, N] = x . W^T (or, with `up`, silu(x . W^T) * (x . U^T)) on 8-bit tiles: x quantized, then work items of
// whole tile pairs, as evenly split as they allow, shared by the caller and the helper threads.
template <typename Fmt>
void RunInt8Product(int64_t m, int64_t k, int64_t n, const float* x, const uint8_t* w, float* y,
                    const uint8_t* up = nullptr) {
  if constexpr (kInt8Tiles<Fmt>) {  // other formats: TakesInt8Tiles says no first
    thread_local Int8Rows xi;
    xi.Quantize(x, m, k);
    const Int8Tiles<Fmt> tiles(m, k, n, &xi, w, y, up);
    RunColumnItems(tiles, n, tiles.ColumnsPerTilePair());
  }
}

}  // namespace jvllm
#else
namespace jvllm {
template <typename Fmt>
void RunInt8Product(int64_t, int64_t, int64_t, const float*, const uint8_t*, float*, const uint8_t* = nullptr) {}
}  // namespace jvllm
#endif
