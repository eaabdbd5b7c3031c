// Products with Q8_0 / Q4_0 / Q4_1 weights whose blocks are interleaved by groups of 8 rows (block_formats.h,
// Interleaved32): y[M, N] = x[M, K] . W[N, K]^T with x quantized to int16 blocks (int16_dots.h).
//
// Each 16 bytes of a group's codes widen to vpmaddwd operands that hold one weight pair of all 8 rows, so a
// broadcast pair of x multiplies 8 outputs at once and a block's int32 sums land one output per lane: per row of x
// and block, 16 vpmaddwd with their adds for 8 outputs, then one conversion, one scale product and two
// multiply-adds (y += d * xd * sums + c * xs; Q8_0 has no c) for all 8, where the row-major blocks need two
// vpmaddwd, an add, a conversion, a multiply-add and a horizontal sum per output. Every row of x takes the same
// operations whatever rows come with it, so a row's bits are its own at any row count. From the caller's
// tile_min_rows rows, the codes are unpacked into 16-bit tiles instead (int16_tiles.h), which reuse x from cache over
// many more rows.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "block_formats.h"
#include "float_tiles.h"
#include "int16_dots.h"
#include "int16_tiles.h"
#include "int8_code_tiles.h"
#include "interleaved_blocks.h"
#include "run_items.h"

namespace jvllm {

// Rows of x against groups of 8 weight rows, the rows of x kChunkRows at a time (a group's blocks stay in L1 for the
// chunks after the first). Work items are ranges of groups.
template <typename Fmt>
class InterleavedRowProduct {
 public:
  static constexpr int kChunkRows = 8;
  static constexpr int64_t kPrefetchGroupBlocks = 8;  // the stream's blocks asked for this far ahead

  InterleavedRowProduct(int64_t m, int64_t k, int64_t n, const Int16Rows* xq, const uint8_t* w, float* y)
      : m_(m), k_(k), n_(n), blocks_(k / Fmt::kWeights), xq_(xq), w_(w), y_(y) {
    const int64_t groups = n / Fmt::kRows, threads = HelperPool::Get().num_helpers() + 1;
    groups_per_item_ = std::max<int64_t>(2, (groups + 2 * threads - 1) / (2 * threads));
  }

  int64_t num_items() const { return (n_ / Fmt::kRows + groups_per_item_ - 1) / groups_per_item_; }

  void Run(int64_t item) const {
    const int64_t g0 = item * groups_per_item_, g1 = std::min(n_ / Fmt::kRows, g0 + groups_per_item_);
    for (int64_t g = g0; g < g1; ++g) {
      ForRowGroups<kChunkRows>(0, m_, [&](auto rows, int64_t m0) { Chunk<decltype(rows)::value>(g, m0); });
    }
  }

 private:
  // Rows [m0, m0 + X) of x against group g -> y[m0 .. m0 + X, 8 g .. 8 g + 8).
  template <int X>
  void Chunk(int64_t g, int64_t m0) const {
    const int64_t k = k_, blocks = blocks_;
    const uint8_t* group = w_ + g * blocks * Fmt::kGroupBytes;
    const int16_t* xq = xq_->q.data() + m0 * k;
    const float* xd = xq_->d.data() + m0 * blocks;
    const float* xs = xq_->s.data() + m0 * blocks;
    __m256 acc[X];
    for (int i = 0; i < X; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = group + b * Fmt::kGroupBytes;
      if (m0 == 0) {  // the first chunk reads the group from memory
        const char* ahead = reinterpret_cast<const char*>(block + kPrefetchGroupBlocks * Fmt::kGroupBytes);
        for (int line = 0; line < Fmt::kGroupBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      __m256 d, c;
      GroupScales<Fmt>(block, d, c);
      __m256i sums[X];
      for (int i = 0; i < X; ++i) sums[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        __m256i low, high;  // pairs (2p, 2p + 1) and (16 + 2p, 17 + 2p) of the 8 rows
        Fmt::Pairs(block, p, low, high);
        for (int i = 0; i < X; ++i) {
          const int16_t* xb = xq + i * k + b * kBlock;
          int32_t low_pair, high_pair;
          std::memcpy(&low_pair, xb + 2 * p, 4);
          std::memcpy(&high_pair, xb + 16 + 2 * p, 4);
          sums[i] = AddPairProducts(sums[i], low, _mm256_set1_epi32(low_pair));
          sums[i] = AddPairProducts(sums[i], high, _mm256_set1_epi32(high_pair));
          KeepInRegister(sums[i]);
        }
      }
      for (int i = 0; i < X; ++i) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[i * blocks + b]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), scale, acc[i]);
        if constexpr (Fmt::kHasMin || Fmt::kCodeOffset != 0.0f) {
          acc[i] = _mm256_fmadd_ps(c, _mm256_set1_ps(xs[i * blocks + b]), acc[i]);
        }
      }
    }
    for (int i = 0; i < X; ++i) _mm256_storeu_ps(y_ + (m0 + i) * n_ + g * Fmt::kRows, acc[i]);
  }

  static constexpr int64_t kBlock = 32;
  int64_t m_, k_, n_, blocks_;
  int64_t groups_per_item_ = 1;
  const Int16Rows* xq_;
  const uint8_t* w_;
  float* y_;
};

// y[M, N] = x[M, K] . W[N, K]^T for interleaved W: row chunks below `tile_min_rows` rows of x (0: always),
// 16-bit code tiles unpacked from the groups from it, work items shared by the caller and the helper threads; from
// `int8_tile_min_rows` rows (0: never) Q4_0 / Q4_1 take 8-bit code tiles instead (int8_code_tiles.h).
template <typename Fmt>
void RunInterleavedProduct(int64_t m, int64_t k, int64_t n, const float* x, const uint8_t* w, float* y,
                           int64_t tile_min_rows, int64_t int8_tile_min_rows = 0) {
  if constexpr (kInt8CodeTiles<Fmt>) {
    if (int8_tile_min_rows > 0 && m >= int8_tile_min_rows) {
      RunInt8CodeTiles<Fmt>(m, k, n, x, w, y);
      return;
    }
  }
  thread_local Int16Rows xq;
  xq.Quantize(x, m, k, Int16Limit<Fmt>());
  if (tile_min_rows == 0 || m < tile_min_rows) {
    RunItems(InterleavedRowProduct<Fmt>(m, k, n, &xq, w, y));
    return;
  }
  RunColumnItems(Int16Tiles<Fmt>(m, k, n, &xq, w, y), n, kTileCols);
}

}  // namespace jvllm

#endif  // __AVX2__
