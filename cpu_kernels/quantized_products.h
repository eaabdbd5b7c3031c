// The row-major GGUF blocks' products for ranges of output rows (Matmul, run by RunItems): y[M, N] = x[M, K] .
// W[N, K]^T with x, y float32 and W as its GGUF blocks (row n = whole blocks of one format). product_paths.h picks,
// by rows of x and this build, which Path a product takes; the paths here: in bfloat16 (Bf16Rows: x and each
// weight block rounded to it, float32 sums, a row's bits its own at any row count; bf16 tiles past kBf16MaxRows,
// bf16_tiles.h), with x quantized to int16 blocks and each weight block unpacked in registers (IntRows,
// int16_dots.h) or into 16-bit code tiles (int16_tiles.h), through float32 weight tiles (float_tiles.h), and a lone
// row through blocks dequantized in registers (Direct). The float paths give the float32 product with the
// dequantized weights up to summation order, the int16 ones within ~3e-5 of it.
//
// The block formats are described in block_formats.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_tiles.h"
#include "block_formats.h"
#include "float_tiles.h"
#include "int16_dots.h"
#include "int16_tiles.h"
#include "run_items.h"

namespace jvllm {

constexpr int64_t kMinRowsPerItem = 16;  // output rows per work item, at least
// The row paths (IntRows, Bf16Dots) take one weight row at a time and prefetch the same block this many rows ahead.
constexpr int64_t kPrefetchRowsAhead = 4;
// The int16 row path scales up to this many rows of x apart, more by row groups (Matmul::IntRows).
constexpr int64_t kIntRowsApart = 2;


inline float Sum(V8 x) {
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += x[i];
  return total;
}

struct Shapes {
  int64_t m, k, n, blocks;  // blocks = k / 32 (sub-blocks of 32 weights a row)
};

// The caller's row-count limits of the paths (quantized_matmul.py: what suits this machine's build).
struct RowPaths {
  int64_t int16_max_rows, int16_tile_min_rows, bf16_max_rows;
  int64_t bf16_min_rows;  // 1: a lone row in bfloat16 too (the same bits as among 2-8 rows), 2: a lone row in int16
  int64_t int8_tile_min_rows;  // from this many rows, 8-bit products where the build and format have them (0: never)
  int64_t invariant_max_rows;  // up to this many rows, the invariant path where the build has it (0: never)
};

// Up to kDirectRows rows of x: each weight block is dequantized in registers and used at once; from 2, the paths of
// float_tiles.h.
constexpr int64_t kDirectRows = 1;
#if !defined(__AVX2__)
struct Int16Rows {};
#endif

// How a product's rows of x meet the weights (Matmul::Run).
enum class Path { kIntRows, kDirect, kFloatTiles, kIntTiles, kBf16Rows, kBf16Tiles };

#if defined(__AVX512BF16__)
// 2 to this many rows of x, on CPUs with AVX-512 BF16: x rounded to bfloat16 once, each weight block dequantized
// in registers and rounded to bfloat16 once for all the rows, then one `vdpbf16ps` (32 multiply-adds into float32)
// per row per 32 weights, where the int16 row path takes about nine instructions. More rows: bf16 tiles
// (bf16_tiles.h).
constexpr int64_t kBf16MaxRows = 8;
#else
constexpr int64_t kBf16MaxRows = 0;
struct Bf16Rows {};
#endif

template <typename Fmt>
class Matmul {
 public:
  // kIntRows and kIntTiles take `xq` (x quantized to int16 blocks); kFloatTiles takes `panels` (x packed by
  // PackPanels) where FloatTiles::TakesPanels; kBf16Tiles may take `up` (w then holds the gate: Bf16Tiles, gated).
  Matmul(Path path, Shapes sh, const float* x, const uint8_t* w, float* y, const Int16Rows* xq = nullptr,
         const float* panels = nullptr, const Bf16Rows* xb = nullptr, const uint8_t* up = nullptr)
      : path_(path), sh_(sh), x_(x), w_(w), y_(y), xq_(xq), xb_(xb), tiles_(sh.m, sh.k, sh.n, x, w, y, panels)
#if defined(__AVX2__)
        , int_tiles_(sh.m, sh.k, sh.n, xq, w, y)
#endif
#if defined(__AVX512BF16__)
        , bf16_tiles_(sh.m, sh.k, sh.n, xb, w, y, up)
#endif
  {
    rows_per_item_ = RowsPerItem();
  }

  // Two contiguous ranges of rows per thread: each thread streams long runs of the weights, and one that started
  // late still finds work. The tiled paths take whole tiles (or pairs), as evenly as those split.
  int64_t RowsPerItem() const {
    const int64_t threads = jvllm::HelperPool::Get().num_helpers() + 1;
    if (path_ == Path::kFloatTiles || path_ == Path::kIntTiles || path_ == Path::kBf16Tiles) {
      int64_t unit = path_ == Path::kFloatTiles ? jvllm::FloatTiles<Fmt>::RowUnit(sh_.m) : jvllm::kTileCols;
#if defined(__AVX512BF16__)
      if (path_ == Path::kBf16Tiles) unit = bf16_tiles_.ColumnsPerTilePair();  // bf16 tiles go in pairs
#endif
      return std::max<int64_t>(kMinRowsPerItem, BalancedUnits((sh_.n + unit - 1) / unit, threads) * unit);
    }
    const int64_t items = 2 * threads, unit = 4;
    return std::max<int64_t>(kMinRowsPerItem, ((sh_.n + items - 1) / items + unit - 1) / unit * unit);
  }
  int64_t num_items() const { return (sh_.n + rows_per_item_ - 1) / rows_per_item_; }

  void Run(int64_t item) const {
    const int64_t n0 = item * rows_per_item_, n1 = std::min(sh_.n, n0 + rows_per_item_);
#if defined(__AVX512BF16__)
    if (path_ == Path::kBf16Tiles) {
      bf16_tiles_.Run(n0, n1);
      return;
    }
    if (path_ == Path::kBf16Rows) {
      switch (sh_.m) {
        case 1: Bf16Range<1>(n0, n1); break;
        case 2: Bf16Range<2>(n0, n1); break;
        case 3: Bf16Range<3>(n0, n1); break;
        case 4: Bf16Range<4>(n0, n1); break;
        case 5: Bf16Range<5>(n0, n1); break;
        case 6: Bf16Range<6>(n0, n1); break;
        case 7: Bf16Range<7>(n0, n1); break;
        default: Bf16Range<8>(n0, n1); break;
      }
      return;
    }
#endif
#if defined(__AVX2__)
    if (path_ == Path::kIntTiles) {
      int_tiles_.Run(n0, n1);
      return;
    }
    if (path_ == Path::kIntRows) {
      for (int64_t m = 0; m < sh_.m; m += Int16Rows::kRowGroup) {
        switch (std::min(Int16Rows::kRowGroup, sh_.m - m)) {
          case 1: IntRange<1>(m, n0, n1); break;
          case 2: IntRange<2>(m, n0, n1); break;
          case 3: IntRange<3>(m, n0, n1); break;
          case 4: IntRange<4>(m, n0, n1); break;
          case 5: IntRange<5>(m, n0, n1); break;
          case 6: IntRange<6>(m, n0, n1); break;
          case 7: IntRange<7>(m, n0, n1); break;
          default: IntRange<8>(m, n0, n1); break;
        }
      }
      return;
    }
#endif
    if (path_ == Path::kDirect) {
      for (int64_t m = 0; m < sh_.m; ++m) Direct(m, n0, n1);
    } else {
      tiles_.Run(n0, n1);
    }
  }

 private:
  int64_t blocks_per_row() const { return sh_.k / Fmt::kWeights; }
  const uint8_t* Row(int64_t n) const { return w_ + n * blocks_per_row() * Fmt::kBytes; }

#if defined(__AVX2__)
  // Rows [m, m + X) of x (quantized) against weight rows [n0, n1), one weight row at a time (see IntRows).
  template <int X>
  void IntRange(int64_t m, int64_t n0, int64_t n1) const {
    for (int64_t n = n0; n < n1; ++n) IntRows<X>(m, n);
  }

  // Rows [m, m + X) of x (X <= kRowGroup, m a multiple of it) against weight row n: each weight block is unpacked
  // once for the X rows while the same block kPrefetchRowsAhead rows on is fetched. Per row and block: two integer
  // dot products, one conversion and a multiply-add by the block's scale d * xd, and a multiply-add of its constant
  // c * xs. Every row takes the same operations whatever X is, so a row's bits do not depend on the rows that come
  // with it. One weight row at a time reads the blocks in address order, which streams at the cores' full
  // bandwidth: the 49,152 x 576 Q8_0 output projection ~30 GB/s for a lone row of x, against ~17 GB/s with four
  // weight rows interleaved; with 2-4 rows of x, decode steps 10-22% faster than with two weight rows interleaved
  // (docs/design/gguf_blocks.md, "Row paths one weight row at a time").
  template <int X>
  void IntRows(int64_t m, int64_t n) const {
    if constexpr (X <= kIntRowsApart) {
      IntRowsApart<X>(m, n);
    } else {
      IntRowsGrouped<X>(m, n);
    }
  }

  // Calls f(b, d, c, w0, w1) for each 32-weight sub-block b of weight row n in order: its scale, its constant term and
  // its codes as 16-bit integers, the same block kPrefetchRowsAhead rows on asked for meanwhile.
  template <typename F>
  void ForSubBlocks(int64_t n, F&& f) const {
    for (int64_t block = 0; block < blocks_per_row(); ++block) {
      const uint8_t* w = Row(n) + block * Fmt::kBytes;
      jvllm::PrefetchBlock<Fmt>(Row(n + kPrefetchRowsAhead) + block * Fmt::kBytes);
      float d[Fmt::kSubs], c[Fmt::kSubs];
      Fmt::Scales(w, d, c);
#pragma GCC unroll 8
      for (int s = 0; s < Fmt::kSubs; ++s) {
        __m256i w0, w1;
        Fmt::Codes16(w, s, w0, w1);
        f(block * Fmt::kSubs + s, d[s], c[s], w0, w1);
      }
    }
  }

  // IntRows for up to kIntRowsApart rows: each row's scales and constants in scalar operations (x as quantized).
  template <int X>
  void IntRowsApart(int64_t m, int64_t n) const {
    const int64_t k = sh_.k, blocks = sh_.blocks;
    const int16_t* xq = xq_->q.data() + m * k;
    const float* xd = xq_->d.data() + m * blocks;
    const float* xs = xq_->s.data() + m * blocks;
    __m256 acc[X];
    float offset[X] = {};
    for (int i = 0; i < X; ++i) acc[i] = _mm256_setzero_ps();
    ForSubBlocks(n, [&](int64_t b, float d, float c, __m256i w0, __m256i w1) {
      for (int i = 0; i < X; ++i) {
        jvllm::Accumulate(w0, w1, xq + i * k + b * kBlock, _mm256_set1_ps(d * xd[i * blocks + b]), acc[i]);
        offset[i] = std::fma(c, xs[i * blocks + b], offset[i]);
      }
    });
    for (int i = 0; i < X; ++i) y_[(m + i) * sh_.n + n] = jvllm::HorizontalSum(acc[i]) + offset[i];
  }

  // IntRows for more rows, the same operations per row: x by row groups (Int16Rows::GroupRows: one pointer reaches
  // them all), each block's scales and constants made for the whole group in one vector operation each, so that
  // what a row adds to a block is its dot products, conversion and multiply-add, the multiply ports' work that
  // bounds the loop from a few rows on. (For one or two rows the scalar form of IntRowsApart is as fast or faster:
  // docs/design/speculative_decoding_measured_2026-12.md, "On AVX2: batch_invariant by default, int16 rows by groups
  // of 8".)
  template <int X>
  void IntRowsGrouped(int64_t m, int64_t n) const {
    constexpr int64_t kGroup = Int16Rows::kRowGroup;
    const int64_t blocks = sh_.blocks;
    const int16_t* group_q = xq_->group_q.data() + m * sh_.k;  // m / kGroup groups of K * kGroup codes
    const float* group_d = xq_->group_d.data() + m * blocks;
    const float* group_s = xq_->group_s.data() + m * blocks;
    __m256 acc[X];
    __m256 offset = _mm256_setzero_ps();  // lane i: row m + i's constant terms
    for (int i = 0; i < X; ++i) acc[i] = _mm256_setzero_ps();
    ForSubBlocks(n, [&](int64_t b, float d, float c, __m256i w0, __m256i w1) {
      const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(group_d + b * kGroup));
      offset = _mm256_fmadd_ps(_mm256_set1_ps(c), _mm256_loadu_ps(group_s + b * kGroup), offset);
      const int16_t* x = group_q + b * kGroup * kBlock;
      for (int i = 0; i < X; ++i) {  // row i's scale in every lane by a shuffle, off the multiply ports
        jvllm::Accumulate(w0, w1, x + i * kBlock, _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(i)), acc[i]);
      }
    });
    alignas(32) float offsets[kGroup];
    _mm256_store_ps(offsets, offset);
    for (int i = 0; i < X; ++i) y_[(m + i) * sh_.n + n] = jvllm::HorizontalSum(acc[i]) + offsets[i];
  }
#endif

#if defined(__AVX512BF16__)
  // All X rows of x (bfloat16) against weight rows [n0, n1), one weight row at a time, as IntRows (steps of 2-8
  // token rows 4-22% faster than with two weight rows interleaved).
  template <int X>
  void Bf16Range(int64_t n0, int64_t n1) const {
    for (int64_t n = n0; n < n1; ++n) Bf16Dots<X>(n);
  }

  // Each row of x sums its products in two accumulators, sub-blocks of 32 weights alternating between them (even
  // ones in the first), added at the end, so that a lone row's `vdpbf16ps` form two dependency chains, not one
  // (docs/design/speculative_decoding.md). Every row count takes the same order: a row's bits do not depend on the
  // rows that come with it.
  template <int X>
  void Bf16Dots(int64_t n) const {
    __m512 even[X], odd[X];
    for (int i = 0; i < X; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    const int64_t blocks = blocks_per_row();
    if constexpr (Fmt::kSubs % 2 == 0) {
      for (int64_t block = 0; block < blocks; ++block) {
        const uint8_t* src = BlockForDots(n, block);
        float d[Fmt::kSubs], c[Fmt::kSubs];
        Fmt::Scales(src, d, c);
#pragma GCC unroll 4
        for (int s = 0; s < Fmt::kSubs; s += 2) {
          AddSubBlock<X>(src, s, d[s], c[s], block * Fmt::kSubs + s, even);
          AddSubBlock<X>(src, s + 1, d[s + 1], c[s + 1], block * Fmt::kSubs + s + 1, odd);
        }
      }
    } else {
      static_assert(Fmt::kSubs == 1);
      int64_t block = 0;
      for (; block + 2 <= blocks; block += 2) {
        AddBlock<X>(n, block, even);
        AddBlock<X>(n, block + 1, odd);
      }
      if (block < blocks) AddBlock<X>(n, block, even);
    }
    for (int i = 0; i < X; ++i) y_[i * sh_.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i]));
  }

  // Weight row n's block `block`, prefetching the same block kPrefetchRowsAhead rows ahead.
  const uint8_t* BlockForDots(int64_t n, int64_t block) const {
    jvllm::PrefetchBlock<Fmt>(Row(n + kPrefetchRowsAhead) + block * Fmt::kBytes);
    return Row(n) + block * Fmt::kBytes;
  }

  // A one-sub-block format's block `block` of weight row n into acc (X rows of x).
  template <int X>
  void AddBlock(int64_t n, int64_t block, __m512 (&acc)[X]) const {
    const uint8_t* src = BlockForDots(n, block);
    float d[1], c[1];
    Fmt::Scales(src, d, c);
    AddSubBlock<X>(src, 0, d[0], c[0], block, acc);
  }

  // Sub-block s of a weight block (sub-block `index` of its row) times the same 32 values of each of X rows of x.
  template <int X>
  void AddSubBlock(const uint8_t* src, int s, float d, float c, int64_t index, __m512 (&acc)[X]) const {
    const __m512bh wb = WeightsBf16<Fmt>(src, s, d, c);
    const uint16_t* xs = xb_->bits.data() + index * kBlock;
    for (int i = 0; i < X; ++i) {
      const __m512i xv = _mm512_loadu_si512(xs + i * sh_.k);
      acc[i] = _mm512_dpbf16_ps(acc[i], wb, reinterpret_cast<const __m512bh&>(xv));
    }
  }
#endif

  // One row of x against weight rows [n0, n1), four at a time.
  void Direct(int64_t m, int64_t n0, int64_t n1) const {
    const float* xr = x_ + m * sh_.k;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) DirectRows<4>(xr, m, n);
    for (; n < n1; ++n) DirectRows<1>(xr, m, n);
  }

  template <int R>
  void DirectRows(const float* xr, int64_t m, int64_t n) const {
    V8 acc[R] = {};
    for (int64_t block = 0; block < blocks_per_row(); ++block) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* src = Row(n + r) + block * Fmt::kBytes;
        jvllm::PrefetchBlock<Fmt>(Row(n + R + r) + block * Fmt::kBytes);
        float d[Fmt::kSubs], c[Fmt::kSubs];
        Fmt::Scales(src, d, c);
#pragma GCC unroll 8
        for (int s = 0; s < Fmt::kSubs; ++s) {
          const float* xb = xr + (block * Fmt::kSubs + s) * kBlock;
          V8 w[kVecsPerSub];
          Fmt::Dequant(src, s, d[s], c[s], w);
          for (int v = 0; v < kVecsPerSub; ++v) acc[r] += w[v] * LoadV(xb + v * kLanes);
        }
      }
    }
    for (int r = 0; r < R; ++r) y_[m * sh_.n + n + r] = Sum(acc[r]);
  }

  Path path_;
  Shapes sh_;
  int64_t rows_per_item_ = 0;  // output rows per work item (RowsPerItem)
  const float* x_;
  const uint8_t* w_;
  float* y_;
  const Int16Rows* xq_;
  const Bf16Rows* xb_;
  jvllm::FloatTiles<Fmt> tiles_;
#if defined(__AVX2__)
  jvllm::Int16Tiles<Fmt> int_tiles_;
#endif
#if defined(__AVX512BF16__)
  jvllm::Bf16Tiles<Fmt> bf16_tiles_;
#endif
};

}  // namespace jvllm
