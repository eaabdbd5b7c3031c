// Reading Q8_0 / Q4_0 / Q4_1 blocks interleaved by groups of 8 rows (block_formats.h, Interleaved32): a group
// block's scales one row per lane, and its codes unpacked into the 16-bit code tiles of int16_tiles.h.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

#include "block_formats.h"
#include "int16_dots.h"

namespace jvllm {

// A group block's d and constant c (Q4_1: m; Q4_0: -8 d; Q8_0: 0) for its 8 rows, one per lane.
template <typename Fmt>
inline void GroupScales(const uint8_t* group_block, __m256& d, __m256& c) {
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_block)));
  if constexpr (Fmt::kHasMin) {
    c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_block + 16)));
  } else {
    c = _mm256_mul_ps(d, _mm256_set1_ps(Fmt::kCodeOffset));
  }
}

// Groups [n / 8, n / 8 + 2) of interleaved weights (the second only if cols is 16) -> a 16-bit code tile
// [K / 2, 16, 2] and its scales d, c [K / 32, 16], as Int16Tiles::TileCodes makes them from row-major blocks:
// each p's two pair vectors are the tile's pairs p and 8 + p of the block for 8 columns.
template <typename Fmt>
void InterleavedTileCodes(const uint8_t* w, int64_t k, int64_t n, int cols, int16_t* codes, float* d, float* c) {
  constexpr int kCols = 16;
  const int64_t blocks = k / Fmt::kWeights;
  for (int half = 0; half < kCols / Fmt::kRows; ++half) {
    const int col0 = half * Fmt::kRows;
    if (col0 >= cols) {
      for (int64_t b = 0; b < blocks; ++b) {
        for (int p = 0; p < 16; ++p) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + ((b * 16 + p) * kCols + col0) * 2),
                              _mm256_setzero_si256());
        }
        _mm256_storeu_ps(d + b * kCols + col0, _mm256_setzero_ps());
        _mm256_storeu_ps(c + b * kCols + col0, _mm256_setzero_ps());
      }
      continue;
    }
    const uint8_t* group = w + (n / Fmt::kRows + half) * blocks * Fmt::kGroupBytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = group + b * Fmt::kGroupBytes;
      const char* ahead = reinterpret_cast<const char*>(block + 4 * Fmt::kGroupBytes);
      for (int line = 0; line < Fmt::kGroupBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      __m256 bd, bc;
      GroupScales<Fmt>(block, bd, bc);
      _mm256_storeu_ps(d + b * kCols + col0, bd);
      _mm256_storeu_ps(c + b * kCols + col0, bc);
      for (int p = 0; p < 8; ++p) {
        __m256i low, high;
        Fmt::Pairs(block, p, low, high);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + ((b * 16 + p) * kCols + col0) * 2), low);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + ((b * 16 + 8 + p) * kCols + col0) * 2), high);
      }
    }
  }
}

}  // namespace jvllm

#endif  // __AVX2__
