// bfloat16 products with GGUF weights on CPUs with AVX-512 BF16 (`vdpbf16ps`: 32 multiply-adds into 16 floats an
// instruction): weight blocks dequantized and rounded to bfloat16, x rounded to bfloat16 once, float32 sums.
// WeightsBf16 gives one 32-weight sub-block in registers (the few-row path of quantized_products.h); Bf16Tiles
// multiplies many rows (prefill and wide decode steps) with weight rows dequantized once per call into tiles of 16
// rows, kept as bf16 pairs, so the scale of each block is inside the weights and every instruction of the inner loop
// is a load, a broadcast or a product (the int16 tiles scale each sub-block's integer sums into float apart); with
// an MLP's gate and up weights, Bf16Tiles gives silu(gate) * up without writing either product. The same tiles take
// plain bfloat16 weights (a float checkpoint's bf16 copy: Bf16OutIn, Bf16InOut), whose pairs are moved, not computed.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "block_formats.h"
#include "code_tiles.h"
#include "float_tiles.h"
#include "line_aligned.h"
#include "prefetch_line.h"
#include "run_items.h"
#include "transpose.h"
#include "vector_exp.h"
#include "word_group_blocks.h"

namespace jvllm {

// Sub-block s of a weight block as 32 bfloat16 weights (rounded from float32 w = d * code + c).
// 4-bit codes: the 16 values a block can hold are computed (one FMA, one rounding) and each weight is looked up
// by its code (`vpermw`), which leaves the floating-point pipes to the products; same values as converting each
// weight, since both round fma(code, d, c). The 16 code bytes (weight j low, j + 16 high) are widened to 32 words
// twice over and the second 16 shifted right by 4; `vpermw` reads an index's low 5 bits, so the table holds the 16
// values twice and a low-nibble word's bit 4 (the high nibble's first bit) picks the same value.
template <typename Fmt>
inline __m512bh WeightsBf16(const uint8_t* b, int s, float d, float c) {
  if constexpr (std::is_same_v<Fmt, Q4_0> || std::is_same_v<Fmt, Q4_1>) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_fmadd_ps(codes, _mm512_set1_ps(d), _mm512_set1_ps(c));
    const __m512bh table = _mm512_cvtne2ps_pbh(values, values);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Fmt::kBytes - 16));
    const __m512i twice = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes));
    const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                            0x0004000400040004, 0, 0, 0, 0);  // words 16-31 by 4
    const __m512i weights = _mm512_permutexvar_epi16(_mm512_srlv_epi16(twice, shifts),
                                                     reinterpret_cast<const __m512i&>(table));
    return reinterpret_cast<const __m512bh&>(weights);
  } else if constexpr (std::is_same_v<Fmt, Q8_0>) {
    const __m512 vd = _mm512_set1_ps(d);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(high, vd), _mm512_mul_ps(low, vd));
  } else {
    V8 w[kVecsPerSub];  // 4 x 8 weights
    Fmt::Dequant(b, s, d, c, w);
    return _mm512_cvtne2ps_pbh(_mm512_insertf32x8(_mm512_castps256_ps512(w[2]), w[3], 1),
                               _mm512_insertf32x8(_mm512_castps256_ps512(w[0]), w[1], 1));
  }
}

// Plain bfloat16 weights in place of GGUF blocks: [N, K] (one row of K per output) or [K, N] (a Linear kernel
// [in, out]); Bf16Tiles<Bf16OutIn> / Bf16Tiles<Bf16InOut> take w as their bits.
struct Bf16OutIn {};
struct Bf16InOut {};

// x [M, K] rounded to bfloat16 (K a multiple of 32), in chunks shared by the caller and the helper threads: a
// prefill step's x comes from DRAM, which one core alone reads at a fraction of the machine's bandwidth.
// Where the products run on AMX, x goes straight into the tile unit's A operand (panels) instead, its last group of
// 16 rows padded with zero rows. The buffers keep their size between calls (a thread's next product reuses them):
// growing one zero-fills the new part, which would otherwise cost a pass over it every call.
struct Bf16Rows {
  LineAlignedVector<uint16_t> bits;    // [M, K], unless use_panels
  LineAlignedVector<uint16_t> panels;  // use_panels: [ceil(M / 16), K / 32, 16, 32], each 16 x 32 tile in one run
  bool use_panels = false;

  // `for_tiles` false: the caller takes another product than Bf16Tiles (Bf16XTiles), which reads no panels.
  void Convert(const float* x, int64_t m, int64_t k, bool for_tiles = true) {
    use_panels = false;
#if JVLLM_AMX
    use_panels = for_tiles && m >= kAmxRows && k % 32 == 0 && AmxUsable();
    if (use_panels) {
      const int64_t groups = (m + kAmxRows - 1) / kAmxRows;
      GrowTo(panels, static_cast<size_t>(groups * kAmxRows * k));
      RunItems(Panels{x, panels.data(), groups, m, k});
      return;
    }
#endif
    GrowTo(bits, static_cast<size_t>(m * k));
    RunItems(Chunks{x, bits.data(), m * k});
  }

 private:
#if JVLLM_AMX
  // Group g of 16 rows of x -> panels, rounded to bfloat16 as Chunks rounds them; rows from m on are zeros.
  struct Panels {
    const float* x;
    uint16_t* panels;
    int64_t groups, m, k;

    int64_t num_items() const { return groups; }
    void Run(int64_t g) const {
      const int64_t chunks = k / 32, live = std::min<int64_t>(kAmxRows, m - g * kAmxRows);
      for (int64_t c = 0; c < chunks; ++c) {
        uint16_t* tile = panels + (g * chunks + c) * kAmxRows * 32;
        for (int r = 0; r < live; ++r) {
          const float* row = x + (g * kAmxRows + r) * k + c * 32;
          const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
          _mm512_store_si512(tile + r * 32, reinterpret_cast<const __m512i&>(v));
        }
        for (int r = live; r < kAmxRows; ++r) _mm512_store_si512(tile + r * 32, _mm512_setzero_si512());
      }
    }
  };
#endif

  struct Chunks {
    static constexpr int64_t kValues = 1 << 14;  // 64 KB of x an item
    const float* x;
    uint16_t* out;
    int64_t total;

    int64_t num_items() const { return (total + kValues - 1) / kValues; }
    void Run(int64_t item) const {
      const int64_t end = std::min(total, (item + 1) * kValues);
      for (int64_t i = item * kValues; i < end; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(out + i, reinterpret_cast<const __m512i&>(v));
      }
    }
  };
};

// y[M, N] = x[M, K] . W[N, K]^T for ranges of output rows, in bfloat16 with float32 sums. Each thread dequantizes
// up to kChunkBytes of its weight rows into tiles of kTileCols rows ([K / 2, kTileCols] bf16 pairs: weights 2p and
// 2p + 1 of a row as one 32-bit lane, so one 512-bit load holds pair p of all 16 rows), then sweeps x kBlockRows
// rows and kDepthPairs pairs at a time, kRowGroup rows against two tiles: 24 float accumulators, two tile vectors and
// a broadcast pair of x per step. With plain bf16 weights and up to kBlockRows rows the chunk is one pair of tiles,
// and the weights of the next pair are prefetched while it is made.
//
// Gated (`up` given): output column n is silu(x . gate_n) * (x . up_n). The two tiles of each step are then a gate
// tile and the up tile of the same 16 columns, summed over the whole depth at once (one slice: the tiles come from
// L2 for K > 2 * kDepthPairs) so the epilogue sees finished sums, and only [M, N] of the activations is written.
//
// On CPUs with AMX (amx_tiles.h, 4-5x these products' speed) x goes 32 rows at a time to the tile unit (16 where
// fewer are left, a last group of fewer than 16 zero-padded) against each pair of a chunk's tiles in turn, and
// from kRowSplitMinRows rows the threads share the rows instead of the columns (SplitsRows).
template <typename Fmt>
class Bf16Tiles {
 public:
  static constexpr int64_t kDepthPairs = 512;  // a tile's depth slice: 16 rows x 512 pairs x 4 bytes = 32 KB (L1)
  static constexpr int kRowGroup = 12;
  // Outputs larger than this, written once (one depth slice), bypass the caches (streaming stores): a decode step's
  // logits [rows, vocab] would otherwise be read into the cache line by line just to be overwritten.
  static constexpr int64_t kStreamBytes = 16 << 20;
  static constexpr int64_t kRowSplitMinRows = 512;  // see SplitsRows
  // A row-split plain product's depth slice on the tile unit: a 32-row block's slice of x (20 KB) stays in L1 while
  // each tile pair's slice passes; a whole K = 576 block of x (36 KB) and a pair's weights outgrow the 48 KB L1.
  static constexpr int64_t kAmxDepthPairs = 160;
  static constexpr int64_t kRowSplitUnit = 32;  // a share of the rows: whole blocks of the tile unit's 32
  static constexpr bool kPlainBf16 = std::is_same_v<Fmt, Bf16OutIn> || std::is_same_v<Fmt, Bf16InOut>;

  Bf16Tiles(int64_t m, int64_t k, int64_t n, const Bf16Rows* xb, const uint8_t* w, float* y,
            const uint8_t* up = nullptr)
      : m_(m), k_(k), n_(n), xb_(xb), w_(w), up_(up), y_(y),
        stream_(up == nullptr && k / 2 <= kDepthPairs && m * n * 4 > kStreamBytes) {}

  // Output columns per pair of tiles (a work item takes whole pairs).
  int64_t ColumnsPerTilePair() const { return up_ == nullptr ? 2 * kTileCols : kTileCols; }

  // Output columns [n0, n1) of every row.
  void Run(int64_t n0, int64_t n1) const { Sweep(0, m_, n0, n1); }

  // Whether the threads share the rows of x rather than the columns (RunRows): on the tile unit with many rows, a
  // thread's share of x then stays in its own caches (a share of the columns reads all of x from L3 once per item),
  // and each of its blocks of x meets every column, for the price of every thread making every tile.
  bool SplitsRows() const {
#if JVLLM_AMX
    return m_ >= kRowSplitMinRows && xb_->use_panels;
#else
    return false;
#endif
  }

  // Rows [m0, m1) of x (m0 a multiple of 32) times every column.
  void RunRows(int64_t m0, int64_t m1) const { Sweep(m0, m1, 0, n_); }

 private:
  void Sweep(int64_t m_begin, int64_t m_end, int64_t n0, int64_t n1) const {
    thread_local LineAlignedVector<uint32_t> tiles;  // [tiles, K / 2, kTileCols] bf16 pairs, one tile after another
    const int64_t pairs = k_ / 2, tile_values = pairs * kTileCols, step = ColumnsPerTilePair();
    // Plain bf16 weights in one block of rows (decode steps, short prompts): each pair of tiles is made right before
    // its products, the next pair's weights asked for as it is made, so they stream in behind the arithmetic.
    // Otherwise a chunk's tiles are made at once (and reused by every block of rows); GGUF blocks, whose tiles cost
    // arithmetic to make, gain nothing from one pair at a time (docs/design/bf16_weights.md).
    const bool streamed = kPlainBf16 && m_ <= kBlockRows;
    const int64_t chunk = streamed ? step : std::max<int64_t>(1, kChunkBytes / (k_ * 2 * kTileCols * 2)) * step;
    const int64_t tiles_per_column_tile = up_ == nullptr ? 1 : 2;
    const int64_t most_tiles = (std::min(chunk, n1 - n0) + kTileCols - 1) / kTileCols * tiles_per_column_tile;
    int64_t depth = up_ == nullptr ? kDepthPairs : pairs;
#if JVLLM_AMX
    const bool amx = m_ >= kAmxRows && xb_->use_panels;  // Convert packed x: AMX usable, K whole 32-value chunks
    std::optional<AmxTileScope> amx_tiles;
    if (amx) amx_tiles.emplace();
    const int64_t block_rows = amx ? 2 * kAmxRows : kBlockRows;
    if (up_ == nullptr && !stream_ && SplitsRows()) {  // even slices of at most kAmxDepthPairs, whole 16s
      const int64_t slices = (pairs + kAmxDepthPairs - 1) / kAmxDepthPairs;
      depth = (pairs / slices + kAmxPairs - 1) / kAmxPairs * kAmxPairs;
    }
#else
    const int64_t block_rows = kBlockRows;
#endif
    GrowTo(tiles, static_cast<size_t>(most_tiles * tile_values));
    auto make = [&](int64_t t, int64_t n, int cols) {
      uint32_t* tile = tiles.data() + t * tile_values;
      // streamed: the weights of the same columns of the next pair are asked for as this tile's are read
      const int64_t ahead = streamed && n - n % step + step < n1 ? step : 0;
      TileWeights(w_, n, cols, tile, ahead);
      if (up_ != nullptr) TileWeights(up_, n, cols, tile + tile_values, 0);
    };
    auto pair = [&](int64_t t, int64_t p0, int64_t p1, int64_t n, int cols, int64_t m0, int64_t m1) {
      const Slice slice{tiles.data() + t * tile_values, p0, p1, n, cols};
#if JVLLM_AMX
      if (amx) {
        AmxGroupsTimesSlice(slice, m0, m1);
        return;
      }
#endif
      ForRowGroups<kRowGroup>(m0, m1, [&](auto rows, int64_t m) { GroupTimesSlice<decltype(rows)::value>(slice, m); });
    };
    SweepTilePairs(m_begin, m_end, n0, n1, chunk, up_ != nullptr, pairs, depth, make, pair, block_rows);
    if (stream_) _mm_sfence();  // streamed stores are seen before the call returns
  }

  // Pairs [p0, p1) of one or two adjacent tiles (`cols` output columns from n: up to 32).
  struct Slice {
    const uint32_t* tiles;  // the first tile [K / 2, kTileCols]; the second follows it
    int64_t p0, p1, n;
    int cols;
  };

  int64_t blocks_per_row() const { return k_ / Fmt::kWeights; }
  const uint8_t* Row(const uint8_t* w, int64_t n) const { return w + n * blocks_per_row() * Fmt::kBytes; }

  // Weight rows [n, n + cols) -> tile [K / 2, kTileCols] of bf16 pairs (zero columns past `cols`). Blocks of 32
  // weights: from their transposed codes (code_tiles.h), or from word groups as they lie (word_group_blocks.h:
  // whole groups of 16 rows). K-quants: each half of 8 rows is dequantized into `rows` [8, K], then its 32-bit
  // pairs are transposed 8 x 8 at a time.
  // Plain bf16 weights with `ahead` > 0: the weights of columns [n + ahead, n + ahead + cols) are asked for
  // along the way (the formats of GGUF blocks ask for their next rows themselves).
  void TileWeights(const uint8_t* w, int64_t n, int cols, uint32_t* tile, int64_t ahead) const {
    if constexpr (std::is_same_v<Fmt, Bf16OutIn>) {
      OutInTile(reinterpret_cast<const float*>(w), n, cols, tile, ahead);
    } else if constexpr (std::is_same_v<Fmt, Bf16InOut>) {
      InOutTile(reinterpret_cast<const uint16_t*>(w), n, cols, tile, ahead);
    } else if constexpr (kWordGroups<Fmt>) {
      TileFromWordGroups<Fmt>(w, k_, n, tile);
    } else if constexpr (kTilesFromCodes<Fmt>) {  // 32-weight blocks: their codes transposed instead (code_tiles.h)
      TileFromCodes<Fmt>(w, blocks_per_row() * Fmt::kBytes, k_, n, cols, tile);
    } else {
      KQuantTile(w, n, cols, tile);
    }
  }

  // Plain [N, K] weights: row n + j's pairs (32-bit units, K / 2 of them a row) -> column j, 8 x 8 transposes;
  // columns past `cols` read zeros.
  void OutInTile(const float* pairs_of_rows, int64_t n, int cols, uint32_t* tile, int64_t ahead) const {
    static const float kZeros[8] = {};
    const int64_t pairs = k_ / 2;
    float* out = reinterpret_cast<float*>(tile);
    for (int half = 0; half < kTileCols / 8; ++half) {
      const float* first = pairs_of_rows + (n + half * 8) * pairs;
      for (int64_t p = 0; p < pairs; p += 8) {
        const auto row = [&](int i) { return half * 8 + i < cols ? first + i * pairs + p : kZeros; };
        if (ahead > 0 && p % 16 == 0) {  // 16 pairs: one line of each of the next pair's 8 rows
          for (int i = 0; i < 8; ++i) PrefetchLine(first + (ahead + i) * pairs + p);
        }
        Transpose8(row, out + p * kTileCols + half * 8, kTileCols);
      }
    }
  }

  // Plain [K, N] weights: weights 2p and 2p + 1 of columns [n, n + cols) -> pair p of the tile's columns, the
  // first in each lane's low half; columns past `cols` are 0.
  void InOutTile(const uint16_t* w, int64_t n, int cols, uint32_t* tile, int64_t ahead) const {
    const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1u);
    for (int64_t p = 0; p < k_ / 2; ++p) {
      if (ahead > 0) {
        PrefetchLine(w + 2 * p * n_ + n + ahead);
        PrefetchLine(w + (2 * p + 1) * n_ + n + ahead);
      }
      const __m256i even = _mm256_maskz_loadu_epi16(live, w + 2 * p * n_ + n);
      const __m256i odd = _mm256_maskz_loadu_epi16(live, w + (2 * p + 1) * n_ + n);
      const __m512i lanes = _mm512_or_si512(_mm512_cvtepu16_epi32(even),
                                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
      _mm512_storeu_si512(tile + p * kTileCols, lanes);
    }
  }

  void KQuantTile(const uint8_t* w, int64_t n, int cols, uint32_t* tile) const {
    thread_local std::vector<uint16_t> rows;
    const int64_t k = k_;
    GrowTo(rows, static_cast<size_t>(8 * k));
    for (int half = 0; half < kTileCols / 8; ++half) {
      for (int r = 0; r < 8; ++r) {
        const int col = half * 8 + r;
        uint16_t* dst = rows.data() + r * k;
        if (col >= cols) {
          std::fill(dst, dst + k, uint16_t{0});
          continue;
        }
        const uint8_t* src = Row(w, n + col);
        for (int64_t block = 0; block < blocks_per_row(); ++block) {
          const uint8_t* w_block = src + block * Fmt::kBytes;
          PrefetchBlock<Fmt>(Row(w, n + col + 8) + block * Fmt::kBytes);
          float d[Fmt::kSubs], c[Fmt::kSubs];
          Fmt::Scales(w_block, d, c);
#pragma GCC unroll 8
          for (int s = 0; s < Fmt::kSubs; ++s) {
            const __m512bh w = WeightsBf16<Fmt>(w_block, s, d[s], c[s]);
            _mm512_storeu_si512(dst + (block * Fmt::kSubs + s) * kBlock, reinterpret_cast<const __m512i&>(w));
          }
        }
      }
      // the pairs as 32-bit units: an 8 x 8 float transpose moves their bits unchanged
      const float* src = reinterpret_cast<const float*>(rows.data());
      float* out = reinterpret_cast<float*>(tile);
      for (int64_t p = 0; p < k / 2; p += 8) Transpose8x8(src + p, k / 2, out + p * kTileCols + half * 8, kTileCols);
    }
  }


  // Rows [m, m + R) of x times the slice -> y[m .. m + R, n .. n + cols), written by the first depth slice and added
  // to by the others. Per pair: each tile's vector, and per row a broadcast pair of x into two products.
  template <int R>
  void GroupTimesSlice(const Slice& slice, int64_t m) const {
    const int64_t pairs = k_ / 2;
    const uint32_t* x = reinterpret_cast<const uint32_t*>(xb_->bits.data()) + m * pairs;
    const uint32_t* t0 = slice.tiles;
    const uint32_t* t1 = slice.tiles + pairs * kTileCols;  // read only when cols > 16
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    if (slice.cols > kTileCols || up_ != nullptr) {
      for (int64_t p = slice.p0; p < slice.p1; ++p) {
        const __m512bh w0 = Pairs(t0 + p * kTileCols), w1 = Pairs(t1 + p * kTileCols);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512bh xr = Broadcast(x + r * pairs + p);
          a0[r] = _mm512_dpbf16_ps(a0[r], w0, xr);
          a1[r] = _mm512_dpbf16_ps(a1[r], w1, xr);
        }
      }
    } else {
      for (int64_t p = slice.p0; p < slice.p1; ++p) {
        const __m512bh w0 = Pairs(t0 + p * kTileCols);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) a0[r] = _mm512_dpbf16_ps(a0[r], w0, Broadcast(x + r * pairs + p));
      }
    }
    for (int r = 0; r < R; ++r) WriteRow(slice, m + r, a0[r], a1[r]);
  }

#if JVLLM_AMX
  // Rows [m0, m1) of x times the slice on the tile unit, 32 or 16 rows at a time (a last group of fewer than 16 as
  // a whole tile of the zero-padded panel: its price is a whole tile's either way, and a row's sums then do not
  // depend on where it falls in the batch). Whole tiles of columns are summed in y itself (the depth
  // slices after the first add to what is there); gated products, a part of a tile or of a group of rows, and
  // streamed outputs go through a buffer.
  void AmxGroupsTimesSlice(const Slice& slice, int64_t m0, int64_t m1) const {
    alignas(64) float buffer[2 * kAmxRows * 2 * kTileCols];  // [32 rows, 32 columns]
    const bool two = slice.cols > kTileCols || up_ != nullptr;
    const bool whole_tiles = up_ == nullptr && !stream_ && slice.cols % kTileCols == 0;
    const uint32_t* t1 = slice.tiles + (k_ / 2) * kTileCols;
    for (int64_t m = m0; m < m1;) {
      const uint16_t* x = xb_->panels.data() + m * k_;  // the panel of rows [m, m + 16): m is a multiple of 16
      const int rows = m + kAmxRows < m1 ? 2 * kAmxRows : kAmxRows;
      const int64_t live = std::min<int64_t>(rows, m1 - m);
      const bool in_y = whole_tiles && live == rows;
      float* sums = in_y ? y_ + m * n_ + slice.n : buffer;
      const int64_t stride = in_y ? n_ : 2 * kTileCols;
      const bool add = in_y && slice.p0 > 0;
      if (rows == 2 * kAmxRows) {
        AmxRowsTimesTiles<2>(x, kAmxRows * k_, slice.tiles, t1, slice.p0, slice.p1, two, sums, stride, add);
      } else {
        AmxRowsTimesTiles<1>(x, kAmxRows * k_, slice.tiles, t1, slice.p0, slice.p1, two, sums, stride, add);
      }
      for (int64_t r = 0; r < live && !in_y; ++r) {
        const float* row = buffer + r * 2 * kTileCols;
        WriteRow(slice, m + r, _mm512_load_ps(row), two ? _mm512_load_ps(row + kTileCols) : _mm512_setzero_ps());
      }
      m += rows;
    }
  }
#endif

  // One row of y from its sums over the slice's depth: s0 for the first tile's columns, s1 for the second's (gated:
  // the gate's and the up projection's sums of the same columns). Columns past the slice's are not written.
  void WriteRow(const Slice& slice, int64_t row, __m512 s0, __m512 s1) const {
    const int cols1 = std::max(0, slice.cols - kTileCols);
    const __mmask16 live0 = static_cast<__mmask16>((1u << std::min(slice.cols, kTileCols)) - 1u);
    float* yr = y_ + row * n_ + slice.n;
    if (up_ != nullptr) {
      _mm512_mask_storeu_ps(yr, live0, Silu512(s0) * s1);
      return;
    }
    Store(yr, live0, s0, slice.p0 == 0);
    if (cols1 > 0) Store(yr + kTileCols, static_cast<__mmask16>((1u << cols1) - 1u), s1, slice.p0 == 0);
  }

  static __m512bh Pairs(const uint32_t* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return reinterpret_cast<const __m512bh&>(v);
  }
  static __m512bh Broadcast(const uint32_t* p) {
    const __m512i v = _mm512_set1_epi32(static_cast<int32_t>(*p));
    return reinterpret_cast<const __m512bh&>(v);
  }
  void Store(float* y, __mmask16 live, __m512 sums, bool first) const {
    if (stream_ && first && live == 0xFFFF && (reinterpret_cast<uintptr_t>(y) & 63) == 0) {
      _mm512_stream_ps(y, sums);
      return;
    }
    _mm512_mask_storeu_ps(y, live, first ? sums : _mm512_add_ps(sums, _mm512_maskz_loadu_ps(live, y)));
  }

  int64_t m_, k_, n_;
  const Bf16Rows* xb_;
  const uint8_t* w_;
  const uint8_t* up_;  // gated: the up weights (w_ then holds the gate's)
  float* y_;
  bool stream_;
};

}  // namespace jvllm
#endif
