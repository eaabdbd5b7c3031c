// Products of many float32 rows (prefill and batched decode steps) with a float checkpoint's bfloat16 weights, as an
// XLA FFI custom call for XLA CPU on CPUs with AVX-512 BF16: x rounded to bfloat16 once, float32 sums, as XLA's
// bf16 x bf16 -> f32 dot, in the tiles of the GGUF blocks' bf16 products (bf16_tiles.h) with the weights' pairs
// moved into them instead of dequantized, or, for a few rows with [N, K] weights, in tiles of x against the weights
// as they lie (bf16_x_tiles.h). Only the step's live rows are multiplied; the padding rows of y are 0.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "bf16_tiles.h"
#include "bf16_x_tiles.h"
#include "run_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kDepthMultiple = 32;  // K: whole 32-value chunks of x to round

ffi::Error Bf16TilesImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> live_rows,
                         ffi::ResultBuffer<ffi::F32> y, bool out_in) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || live_rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("bf16_tiles: x [M, K], w of rank 2 and live_rows []");
  }
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = out_in ? wd[0] : wd[1];
  if ((out_in ? wd[1] : wd[0]) != k) return ffi::Error::InvalidArgument("bf16_tiles: w does not take x's K");
  if (k % kDepthMultiple != 0) return ffi::Error::InvalidArgument("bf16_tiles: K must be a multiple of 32");
#if defined(__AVX512BF16__)
  const int64_t live = std::clamp<int64_t>(live_rows.typed_data()[0], 0, m);
  float* out = y->typed_data();
  std::memset(out + live * n, 0, sizeof(float) * (m - live) * n);
  if (live == 0 || n == 0) return ffi::Error::Success();
  const bool x_tiles = out_in && jvllm::Bf16XTiles::Takes(live);  // few rows: [N, K] weights read in place
  thread_local jvllm::Bf16Rows xb;  // its buffers reused by this thread's next call
  xb.Convert(x.typed_data(), live, k, /*for_tiles=*/!x_tiles);
  const auto* bits = reinterpret_cast<const uint8_t*>(w.typed_data());
  if (x_tiles) {
    const jvllm::Bf16XTiles tiles(live, k, n, xb.bits.data(), reinterpret_cast<const uint16_t*>(bits), out);
    jvllm::RunColumnItems(tiles, n, tiles.ColumnsPerItemUnit());
  } else if (out_in) {
    const jvllm::Bf16Tiles<jvllm::Bf16OutIn> tiles(live, k, n, &xb, bits, out);
    jvllm::RunTileItems(tiles, live, n, tiles.ColumnsPerTilePair(), tiles.kRowSplitUnit);
  } else {
    const jvllm::Bf16Tiles<jvllm::Bf16InOut> tiles(live, k, n, &xb, bits, out);
    jvllm::RunTileItems(tiles, live, n, tiles.ColumnsPerTilePair(), tiles.kRowSplitUnit);
  }
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("bf16_tiles: this build has no AVX-512 BF16");
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmBf16Tiles, Bf16TilesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("out_in"));

// Whether this build multiplies bf16 weights in tiles (AVX-512 BF16).
extern "C" int64_t JvllmBf16TilesAvailable() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// Whether many-row bf16 products here run on the AMX tile unit (amx_tiles.h): the build has it, the kernel granted
// this process the tile registers and JVLLM_CPU_AMX is not 0.
extern "C" int64_t JvllmAmxProducts() {
#if JVLLM_AMX
  return jvllm::AmxUsable() ? 1 : 0;
#else
  return 0;
#endif
}
