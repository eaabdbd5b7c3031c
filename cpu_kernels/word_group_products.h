// Products with Q8_0 / Q4_0 / Q4_1 weights grouped by code words for 16 rows (block_formats.h, WordGroups32; the
// projections' layout on AVX-512 builds with BF16): up to the invariant path's rows on that path, which reads the
// groups' pair vectors straight from memory (each row's bits the same whatever rows come with it, and the same as
// with the row-major blocks), and more rows through bfloat16 tiles made from the groups (bf16_tiles.h), or the 8-bit
// tiles where asked for (int8_tiles.h).
#pragma once

#include "word_group_blocks.h"

#if JVLLM_WORD_GROUPS
#include <algorithm>
#include <cstdint>

#include "bf16_tiles.h"
#include "int8_tiles.h"
#include "invariant_products.h"
#include "run_items.h"

namespace jvllm {

// y[M, N] = x[M, K] . W[N, K]^T, or with `up` silu(x . W^T) * (x . U^T), for word-grouped W (and U): the invariant
// path up to `invariant_max_rows` rows of x or where `bf16_tiles` is false; past it the 8-bit tiles from
// `int8_tile_min_rows` rows (if not 0; Q4_0 / Q4_1 on AVX-512 VNNI builds), else bfloat16 tiles.
template <typename Fmt>
void RunWordGroupProduct(int64_t m, int64_t k, int64_t n, const float* x, const uint8_t* w, float* y,
                         const uint8_t* up, int64_t invariant_max_rows, bool bf16_tiles, int64_t int8_tile_min_rows) {
  if (m <= invariant_max_rows || !bf16_tiles) {
    RunInvariantProduct<Fmt>(m, k, n, x, w, y, up);
    return;
  }
  if (TakesInt8Tiles<Fmt>(m, int8_tile_min_rows)) {
    RunInt8Product<Fmt>(m, k, n, x, w, y, up);
    return;
  }
  thread_local Bf16Rows xb;
  xb.Convert(x, m, k);
  const Bf16Tiles<Fmt> tiles(m, k, n, &xb, w, y, up);
  RunTileItems(tiles, m, n, tiles.ColumnsPerTilePair(), tiles.kRowSplitUnit);
}

}  // namespace jvllm

#endif  // JVLLM_WORD_GROUPS
