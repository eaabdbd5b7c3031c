// Few rows of x times bfloat16 weight rows [N, K] read in place (AVX-512 BF16): the tiles are made of x instead of
// the weights. x's rows, rounded to bfloat16, are packed once into [K / 2, 16 x V] 32-bit pairs (V vectors of 16
// rows; lane j of pair p: x[j][2p], x[j][2p + 1]); each weight row's pair p is broadcast against them, so every
// product sums into one output column for 16 rows of x at once, and the weights are read as they lie, 8 rows side by
// side, with nothing moved per call (a decode step's LM head is 56 MB of them for SmolLM2-135M).
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "prefetch_line.h"
#include "transpose.h"

namespace jvllm {

// x [M, K] as bf16 bits -> its pairs transposed: [K / 2, 16 * vectors] 32-bit lanes, rows past M zero.
inline void PackXPairs(const uint16_t* x, int64_t m, int64_t k, int vectors, std::vector<uint32_t>& out) {
  const int64_t pairs = k / 2, cols = 16 * vectors;
  out.assign(static_cast<size_t>(pairs * cols), 0u);
  const auto* rows = reinterpret_cast<const uint32_t*>(x);  // [M, K / 2]
  int64_t r = 0;
  for (; r + 8 <= m; r += 8) {
    for (int64_t p = 0; p + 8 <= pairs; p += 8) {
      Transpose8x8(reinterpret_cast<const float*>(rows + r * pairs + p), pairs,
                   reinterpret_cast<float*>(out.data() + p * cols + r), cols);
    }
    for (int64_t p = pairs / 8 * 8; p < pairs; ++p) {
      for (int64_t i = 0; i < 8; ++i) out[p * cols + r + i] = rows[(r + i) * pairs + p];
    }
  }
  for (; r < m; ++r) {
    for (int64_t p = 0; p < pairs; ++p) out[p * cols + r] = rows[r * pairs + p];
  }
}

// y[M, N] = x[M, K] . W[N, K]^T, M <= 16 * kMaxXVectors, W bf16 bits; work items are ranges of output columns.
class Bf16XTiles {
 public:
  static constexpr int kMaxXVectors = 3;  // rows of x: 16 a vector
  static constexpr int kWeightRows = 8;   // weight rows (output columns) a pass: 8 x vectors sums in registers

  // x: [m, k] bf16 bits of the live rows; y: [m, n] float32 (row stride n).
  Bf16XTiles(int64_t m, int64_t k, int64_t n, const uint16_t* x, const uint16_t* w, float* y)
      : m_(m), k_(k), n_(n), vectors_(static_cast<int>((m + 15) / 16)), w_(w), y_(y) {
    PackXPairs(x, m, k, vectors_, x_pairs_);
  }

  static bool Takes(int64_t m) { return m >= 1 && m <= 16 * kMaxXVectors; }
  int64_t ColumnsPerItemUnit() const { return kWeightRows; }

  void Run(int64_t n0, int64_t n1) const {
    switch (vectors_) {
      case 1: Columns<1>(n0, n1); break;
      case 2: Columns<2>(n0, n1); break;
      default: Columns<3>(n0, n1); break;
    }
  }

 private:
  template <int V>
  void Columns(int64_t n0, int64_t n1) const {
    const int64_t pairs = k_ / 2;
    const auto* w = reinterpret_cast<const uint32_t*>(w_);  // [N, K / 2] pairs
    const uint32_t* xp = x_pairs_.data();
    for (int64_t n = n0; n < n1; n += kWeightRows) {
      const int cols = static_cast<int>(std::min<int64_t>(kWeightRows, n1 - n));
      const uint32_t* rows[kWeightRows];
      for (int i = 0; i < kWeightRows; ++i) rows[i] = w + (n + std::min(i, cols - 1)) * pairs;  // past N: reread
      LinesAhead ahead;  // the next pass's weight rows (contiguous), asked for over this pass's pairs
      if (n + kWeightRows < n1) {
        ahead.first = reinterpret_cast<const char*>(w + (n + kWeightRows) * pairs);
        ahead.count = (std::min<int64_t>(kWeightRows, n1 - n - kWeightRows) * pairs * 4 + 63) / 64;
        ahead.per_step = (ahead.count + pairs - 1) / pairs;
      }
      __m512 acc[kWeightRows][V];
      for (int i = 0; i < kWeightRows; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        ahead.Ask();
        __m512i xv[V];
        for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_si512(xp + p * 16 * V + 16 * v);
#pragma GCC unroll 8
        for (int i = 0; i < kWeightRows; ++i) {
          const __m512i b = _mm512_set1_epi32(static_cast<int32_t>(rows[i][p]));
          for (int v = 0; v < V; ++v) {
            acc[i][v] = _mm512_dpbf16_ps(acc[i][v], reinterpret_cast<const __m512bh&>(xv[v]),
                                         reinterpret_cast<const __m512bh&>(b));
          }
        }
      }
      Store<V>(acc, n, cols);
    }
  }

  // acc[i][v] lane j is y[16 v + j, n + i]: 8 x 8 transposes into y's rows, the edges element by element.
  template <int V>
  void Store(const __m512 (&acc)[kWeightRows][V], int64_t n, int cols) const {
    alignas(64) float sums[kWeightRows][16 * V];
    for (int i = 0; i < kWeightRows; ++i)
      for (int v = 0; v < V; ++v) _mm512_store_ps(sums[i] + 16 * v, acc[i][v]);
    for (int64_t j0 = 0; j0 < m_; j0 += 8) {
      if (j0 + 8 <= m_ && cols == kWeightRows) {
        Transpose8([&](int i) { return sums[i] + j0; }, y_ + j0 * n_ + n, n_);
        continue;
      }
      for (int64_t j = j0; j < std::min<int64_t>(m_, j0 + 8); ++j)
        for (int i = 0; i < cols; ++i) y_[j * n_ + n + i] = sums[i][j];
    }
  }

  int64_t m_, k_, n_;
  int vectors_;
  const uint16_t* w_;
  float* y_;
  std::vector<uint32_t> x_pairs_;  // [K / 2, 16 * vectors_]
};

}  // namespace jvllm
#endif
