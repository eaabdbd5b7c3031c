// Which path a product with GGUF-quantized weights takes, for the XLA FFI handlers of quantized_matmul.cc:
// y[M, N] = x[M, K] . W[N, K]^T (RunProduct), and the gated product act(x . G^T) * (x . U^T) of an MLP's gate and up
// projections (RunGatedProduct).
//
// By the rows of x (the caller's RowPaths: what suits this machine's build): on CPUs with AVX-512 BF16, the caller's
// bf16_min_rows (1 or 2) to bf16_max_rows rows (at most 8) in bfloat16, more through bf16 tiles; few rows (up to the
// caller's int16_max_rows) with x quantized to int16 blocks, each weight block unpacked in registers; from
// int16_tile_min_rows x so quantized against 16-bit code tiles; the rows between through float32 weight tiles, a
// lone row without int16 through blocks dequantized in registers (those paths: Matmul, quantized_products.h). From
// int8_tile_min_rows (CPUs with AVX-512 VNNI; Q4_0, Q4_1, Q4_K, Q5_K) x is quantized to int8 blocks against 8-bit
// code tiles (int8_tiles.h). Up to the caller's invariant_max_rows (AVX-512 builds), the invariant path instead:
// int16 x with exact block sums, each row's bits its own at any row count (invariant_products.h). Q8_0 / Q4_0 / Q4_1
// interleaved by groups of 8 rows (AVX2 builds' layout for them) take their own paths with int16 x
// (interleaved_products.h), or Q4_0 / Q4_1 from int8_tile_min_rows 8-bit code tiles (int8_code_tiles.h); in groups
// of 16 rows (AVX-512 BF16 builds), word_group_products.h. Work items are shared by the caller and the kernels'
// helper threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_formats.h"
#include "int8_tiles.h"
#include "interleaved_products.h"
#include "invariant_products.h"
#include "quantized_products.h"
#include "run_items.h"
#include "vector_exp.h"
#include "word_group_products.h"

namespace jvllm {

#if defined(__AVX512BF16__)
// Bf16Tiles' products (gated with `up`) over the threads: by rows where the tiles split them (the tile unit, many
// rows), else by columns as Matmul's items take them.
template <typename Fmt>
void RunBf16TileProduct(Shapes sh, const float* x, const uint8_t* w, float* y, const Bf16Rows* xb,
                        const uint8_t* up = nullptr) {
  const jvllm::Bf16Tiles<Fmt> tiles(sh.m, sh.k, sh.n, xb, w, y, up);
  if (tiles.SplitsRows()) {
    jvllm::RunTileItems(tiles, sh.m, sh.n, tiles.ColumnsPerTilePair(), tiles.kRowSplitUnit);
    return;
  }
  Matmul<Fmt> work(Path::kBf16Tiles, sh, x, w, y, nullptr, nullptr, xb, up);
  jvllm::RunItems(work);
}
#endif

// y[M, N] = x[M, K] . W[N, K]^T, W [N, K] in format Fmt, on the path its rows of x take (above).
template <typename Fmt>
void RunProduct(Shapes sh, const float* x, const uint8_t* w, float* y, const RowPaths& paths) {
  if constexpr (kWordGroups<Fmt>) {
#if JVLLM_WORD_GROUPS
    RunWordGroupProduct<Fmt>(sh.m, sh.k, sh.n, x, w, y, nullptr, paths.invariant_max_rows, paths.bf16_max_rows > 0,
                             paths.int8_tile_min_rows);
#endif
  } else if constexpr (kInterleavedRows<Fmt>) {
#if defined(__AVX2__)
    RunInterleavedProduct<Fmt>(sh.m, sh.k, sh.n, x, w, y, paths.int16_tile_min_rows, paths.int8_tile_min_rows);
#endif
  } else {
    if (TakesInvariantProduct<Fmt>(sh.m, paths.invariant_max_rows)) {
      RunInvariantProduct<Fmt>(sh.m, sh.k, sh.n, x, w, y);
      return;
    }
    if (TakesInt8Tiles<Fmt>(sh.m, paths.int8_tile_min_rows)) {
      RunInt8Product<Fmt>(sh.m, sh.k, sh.n, x, w, y);
      return;
    }
#if defined(__AVX512BF16__)
    if (paths.bf16_max_rows > 0 && sh.m >= paths.bf16_min_rows) {  // bfloat16 products: rows, tiles past kBf16MaxRows
      thread_local Bf16Rows xb;
      xb.Convert(x, sh.m, sh.k);
      if (sh.m > std::min(paths.bf16_max_rows, kBf16MaxRows)) {
        RunBf16TileProduct<Fmt>(sh, x, w, y, &xb);
        return;
      }
      Matmul<Fmt> work(Path::kBf16Rows, sh, x, w, y, nullptr, nullptr, &xb);
      jvllm::RunItems(work);
      return;
    }
#endif
#if defined(__AVX2__)
    const bool int_rows = sh.m <= paths.int16_max_rows;
    if (int_rows || (paths.int16_tile_min_rows > 0 && sh.m >= paths.int16_tile_min_rows)) {
      thread_local Int16Rows xq;
      xq.Quantize(x, sh.m, sh.k, int_rows ? 32767 : jvllm::Int16Limit<Fmt>());
      if (int_rows && sh.m > kIntRowsApart) xq.GroupRows(sh.m, sh.k);
      Matmul<Fmt> work(int_rows ? Path::kIntRows : Path::kIntTiles, sh, x, w, y, &xq);
      jvllm::RunItems(work);
      return;
    }
#endif
    if (sh.m <= kDirectRows) {
      Matmul<Fmt> work(Path::kDirect, sh, x, w, y);
      jvllm::RunItems(work);
      return;
    }
    thread_local std::vector<float> panels;
    if (jvllm::FloatTiles<Fmt>::TakesPanels(sh.m)) jvllm::PackPanels(x, sh.m, sh.k, panels);
    Matmul<Fmt> work(Path::kFloatTiles, sh, x, w, y, nullptr, panels.data());
    jvllm::RunItems(work);
  }
}

// y[i] = silu(y[i]) * up[i] over `total` values, in chunks shared by the caller and the helper threads.
struct SiluTimes {
  static constexpr int64_t kValues = 1 << 14;
  float* y;
  const float* up;
  int64_t total;

  int64_t num_items() const { return (total + kValues - 1) / kValues; }
  void Run(int64_t item) const {
    typedef int32_t I8 __attribute__((vector_size(32)));
    const int64_t begin = item * kValues, end = std::min(total, begin + kValues);
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      const V8 v = SiluVector<V8, I8>(LoadV(y + i)) * LoadV(up + i);
      std::memcpy(y + i, &v, sizeof v);
    }
    if (i < end) {  // the tail through the same vector code, so that a value's bits do not depend on where it falls
      float tail_y[kLanes] = {}, tail_up[kLanes] = {};
      std::memcpy(tail_y, y + i, sizeof(float) * (end - i));
      std::memcpy(tail_up, up + i, sizeof(float) * (end - i));
      const V8 v = SiluVector<V8, I8>(LoadV(tail_y)) * LoadV(tail_up);
      std::memcpy(y + i, &v, sizeof(float) * (end - i));
    }
  }
};

// RunGatedProduct for row-major and x8-interleaved blocks.
template <typename Fmt>
void RunGatedRowsProduct(Shapes sh, const float* x, const uint8_t* gate, const uint8_t* up, float* y,
                         const RowPaths& paths) {
  if constexpr (!kInterleavedRows<Fmt>) {
    if (TakesInvariantProduct<Fmt>(sh.m, paths.invariant_max_rows)) {
      RunInvariantProduct<Fmt>(sh.m, sh.k, sh.n, x, gate, y, up);
      return;
    }
    if (TakesInt8Tiles<Fmt>(sh.m, paths.int8_tile_min_rows)) {
      RunInt8Product<Fmt>(sh.m, sh.k, sh.n, x, gate, y, up);
      return;
    }
#if defined(__AVX512BF16__)
    if (paths.bf16_max_rows > 0 && sh.m > std::min(paths.bf16_max_rows, kBf16MaxRows)) {
      thread_local Bf16Rows xb;
      xb.Convert(x, sh.m, sh.k);
      RunBf16TileProduct<Fmt>(sh, x, gate, y, &xb, up);
      return;
    }
#endif
  }
  thread_local std::vector<float> up_out;  // [M, N]
  up_out.resize(static_cast<size_t>(sh.m * sh.n));
  RunProduct<Fmt>(sh, x, gate, y, paths);
  RunProduct<Fmt>(sh, x, up, up_out.data(), paths);
  jvllm::RunItems(SiluTimes{y, up_out.data(), sh.m * sh.n});
}

// y[M, N] = silu(x . G^T) * (x . U^T), G and U [N, K] in one format (an MLP's gate and up projections). Where the
// rows take bf16 tiles, one pass gives the activations (Bf16Tiles, gated); otherwise the two products are made
// apart and combined.
template <typename Fmt>
void RunGatedProduct(Shapes sh, const float* x, const uint8_t* gate, const uint8_t* up, float* y,
                     const RowPaths& paths) {
  if constexpr (kWordGroups<Fmt>) {
#if JVLLM_WORD_GROUPS
    RunWordGroupProduct<Fmt>(sh.m, sh.k, sh.n, x, gate, y, up, paths.invariant_max_rows, paths.bf16_max_rows > 0,
                             paths.int8_tile_min_rows);
#endif
  } else {
    RunGatedRowsProduct<Fmt>(sh, x, gate, up, y, paths);
  }
}

}  // namespace jvllm
