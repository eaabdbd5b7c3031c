// Matrix products with GGUF-quantized weights for XLA CPU, as XLA FFI custom calls (product_paths.h; each
// format's products are compiled apart: format_products.h):
//   jvllm_quantized_matmul:  y[M, N] = x[M, K] . W[N, K]^T
//   jvllm_gated_matmul:      y[M, N] = silu(x . G^T) * (x . U^T)   (an MLP's gate and up projections)
// x and y float32, the weights as their GGUF blocks (row n = whole blocks of one format).
//
// A step's x is padded to its shape's rows; `live_rows` (a traced scalar) says how many lead rows are real tokens.
// Only those are multiplied (the path is chosen by their count); the padding rows of y are 0.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "block_formats.h"
#include "format_products.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jvllm::kBlock;
using jvllm::RowPaths;
using jvllm::Shapes;

// Checks the operands, zeroes the padding rows of y and gives the live rows' shapes (m = 0: nothing to multiply).
ffi::Error LiveShapes(const char* what, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& w,
                      ffi::Buffer<ffi::S32>& live_rows, ffi::Result<ffi::Buffer<ffi::F32>>& y, Shapes* sh) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] % kBlock != 0 || live_rows.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(what) + ": x [M, K] with K a multiple of 32, w [N, row bytes], "
                                       "live_rows []");
  }
  const int64_t live = std::clamp<int64_t>(live_rows.typed_data()[0], 0, xd[0]);
  *sh = Shapes{live, xd[1], wd[0], xd[1] / kBlock};
  std::memset(y->typed_data() + live * sh->n, 0, sizeof(float) * (xd[0] - live) * sh->n);
  return ffi::Error::Success();
}

// Calls body(Fmt{}) with the block format named by `format`, after checking that a weight row of `row_bytes` is
// whole blocks of it (and for the interleaved formats, x8 and x16, that the n rows are whole groups of their rows).
template <typename Body>
ffi::Error WithFormat(const char* what, int64_t format, int64_t k, int64_t n, int64_t row_bytes, Body body) {
  auto checked = [&](auto fmt) {
    using Fmt = decltype(fmt);
    if (k % Fmt::kWeights != 0 || row_bytes != k / Fmt::kWeights * Fmt::kBytes) {
      return ffi::Error::InvalidArgument(std::string(what) + ": a weight row must be whole blocks of its format");
    }
    if constexpr (jvllm::kInterleavedRows<Fmt> || jvllm::kWordGroups<Fmt>) {
      if (n % Fmt::kRows != 0) {
        return ffi::Error::InvalidArgument(std::string(what) + ": interleaved weights come in groups of " +
                                           std::to_string(Fmt::kRows) + " rows");
      }
    }
    body(fmt);
    return ffi::Error::Success();
  };
  switch (format) {
    case jvllm::kQ8_0: return checked(jvllm::Q8_0{});
    case jvllm::kQ4_0: return checked(jvllm::Q4_0{});
    case jvllm::kQ4_1: return checked(jvllm::Q4_1{});
    case jvllm::kQ4_K: return checked(jvllm::Q4_K{});
    case jvllm::kQ5_K: return checked(jvllm::Q5_K{});
    case jvllm::kQ6_K: return checked(jvllm::Q6_K{});
#if defined(__AVX2__)
    case jvllm::kQ4_0x8: return checked(jvllm::Q4_0x8{});
    case jvllm::kQ4_1x8: return checked(jvllm::Q4_1x8{});
    case jvllm::kQ8_0x8: return checked(jvllm::Q8_0x8{});
#endif
#if JVLLM_WORD_GROUPS
    case jvllm::kQ4_0x16: return checked(jvllm::Q4_0x16{});
    case jvllm::kQ4_1x16: return checked(jvllm::Q4_1x16{});
    case jvllm::kQ8_0x16: return checked(jvllm::Q8_0x16{});
#endif
    default: return ffi::Error::InvalidArgument(std::string(what) + ": unknown format");
  }
}

ffi::Error QuantizedMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> live_rows,
                               ffi::ResultBuffer<ffi::F32> y, int64_t format, int64_t int16_max_rows,
                               int64_t int16_tile_min_rows, int64_t bf16_max_rows, int64_t bf16_min_rows,
                               int64_t int8_tile_min_rows, int64_t invariant_max_rows) {
  constexpr const char* kWhat = "quantized_matmul";
  Shapes sh;
  if (ffi::Error error = LiveShapes(kWhat, x, w, live_rows, y, &sh); error.failure()) return error;
  if (sh.m == 0) return ffi::Error::Success();
  const RowPaths paths{int16_max_rows,     int16_tile_min_rows, bf16_max_rows,
                       bf16_min_rows,      int8_tile_min_rows,  invariant_max_rows};
  return WithFormat(kWhat, format, sh.k, sh.n, w.dimensions()[1], [&](auto fmt) {
    jvllm::RunProduct<decltype(fmt)>(sh, x.typed_data(), w.typed_data(), y->typed_data(), paths);
  });
}

ffi::Error GatedMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> gate, ffi::Buffer<ffi::U8> up,
                           ffi::Buffer<ffi::S32> live_rows, ffi::ResultBuffer<ffi::F32> y, int64_t format,
                           int64_t int16_max_rows, int64_t int16_tile_min_rows, int64_t bf16_max_rows,
                           int64_t bf16_min_rows, int64_t int8_tile_min_rows, int64_t invariant_max_rows) {
  constexpr const char* kWhat = "gated_matmul";
  const auto gd = gate.dimensions(), ud = up.dimensions();
  if (gd.size() != ud.size() || !std::equal(gd.begin(), gd.end(), ud.begin())) {
    return ffi::Error::InvalidArgument("gated_matmul: the gate and up weights differ in shape");
  }
  Shapes sh;
  if (ffi::Error error = LiveShapes(kWhat, x, gate, live_rows, y, &sh); error.failure()) return error;
  if (sh.m == 0) return ffi::Error::Success();
  const RowPaths paths{int16_max_rows,     int16_tile_min_rows, bf16_max_rows,
                       bf16_min_rows,      int8_tile_min_rows,  invariant_max_rows};
  return WithFormat(kWhat, format, sh.k, sh.n, gate.dimensions()[1], [&](auto fmt) {
    jvllm::RunGatedProduct<decltype(fmt)>(sh, x.typed_data(), gate.typed_data(), up.typed_data(), y->typed_data(),
                                          paths);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmQuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w [N, K / block weights * block bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live_rows []: the lead rows of x to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("int16_max_rows")
                                  .Attr<int64_t>("int16_tile_min_rows")
                                  .Attr<int64_t>("bf16_max_rows")
                                  .Attr<int64_t>("bf16_min_rows")
                                  .Attr<int64_t>("int8_tile_min_rows")
                                  .Attr<int64_t>("invariant_max_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmGatedMatmul, GatedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // gate [N, K / block weights * block bytes]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // up, as gate
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live_rows []: the lead rows of x to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("int16_max_rows")
                                  .Attr<int64_t>("int16_tile_min_rows")
                                  .Attr<int64_t>("bf16_max_rows")
                                  .Attr<int64_t>("bf16_min_rows")
                                  .Attr<int64_t>("int8_tile_min_rows")
                                  .Attr<int64_t>("invariant_max_rows"));

// The row counts at which this build's paths meet (measured per vector width: docs/design/gguf_blocks.md): the
// per-row int16 path up to the first, 16-bit code tiles from the second, float tiles between (AVX2 builds only).
#if JVLLM_INT16_512
constexpr int32_t kInt16MaxRows = 4, kInt16TileMinRows = 5;
#elif defined(__AVX2__)
constexpr int32_t kInt16MaxRows = 8, kInt16TileMinRows = 64;
#else
constexpr int32_t kInt16MaxRows = 0, kInt16TileMinRows = 0;
#endif

extern "C" int32_t JvllmInt16MaxRows() { return kInt16MaxRows; }
extern "C" int32_t JvllmInt16TileMinRows() { return kInt16TileMinRows; }
// 1 where the build multiplies Q8_0 / Q4_0 / Q4_1 weights interleaved by groups of 8 rows (q8_0x8, ...) and they are
// this CPU's layout for them: AVX2 builds without AVX-512's 16-bit code tiles, where the row-major blocks' few-row
// products are bound by their per-output work (docs/design/gguf_blocks.md). AVX-512 builds can multiply them too.
extern "C" int32_t JvllmInterleavedRowsPreferred() {
#if defined(__AVX2__) && !JVLLM_INT16_512
  return 1;
#else
  return 0;
#endif
}
// 1 where the build multiplies Q8_0 / Q4_0 / Q4_1 weights grouped by code words for 16 rows (q8_0x16, ...), this
// CPU's layout for them: AVX-512 builds with BF16, where the invariant path then reads its pair vectors without
// transposing 16 rows' blocks (docs/design/gguf_blocks.md).
extern "C" int32_t JvllmWordGroupsPreferred() { return JVLLM_WORD_GROUPS; }
// Up to this many rows, products with the formats of invariant_products.h can take its path (0: the build has none).
extern "C" int32_t JvllmInvariantMaxRows() { return JVLLM_INT16_512 ? 32 : 0; }
// From this many rows (up to 16) the invariant path's word-group products sum their blocks on the AMX tile unit
// (amx_block_sums.h: CPUs with AMX-INT8 whose tiles Linux granted, JVLLM_CPU_AMX not 0); 0: never. The same bits.
extern "C" int32_t JvllmAmxBlockSumMinRows() {
#if JVLLM_AMX_INT8 && JVLLM_WORD_GROUPS
  return jvllm::AmxUsable() ? static_cast<int32_t>(jvllm::AmxBlockSumMinRows()) : 0;
#else
  return 0;
#endif
}
extern "C" int32_t JvllmBf16MaxRows() { return static_cast<int32_t>(jvllm::kBf16MaxRows); }
// From this many rows, 8-bit products with 4- and 5-bit blocks: on CPUs with AVX-512 VNNI from where the bf16 tiles
// take over from the bf16 rows (the 8-bit tiles are at least as fast from there), on AVX2 builds for the interleaved
// Q4_0 / Q4_1 groups from where their 8-bit code tiles pass the int16 row chunks (docs/design/gguf_blocks.md).
extern "C" int32_t JvllmInt8TileMinRows() {
#if JVLLM_INT8_TILES
  return 9;
#elif defined(__AVX2__)
  return static_cast<int32_t>(jvllm::kInt8CodeTileMinRows);
#else
  return 0;
#endif
}
// The block formats (bits by jvllm::Format) whose products take 8-bit tiles from JvllmInt8TileMinRows rows.
extern "C" int32_t JvllmInt8TileFormats() {
  int32_t formats = 0;
#if JVLLM_INT8_TILES
  for (int f : {jvllm::kQ4_0, jvllm::kQ4_1, jvllm::kQ4_K, jvllm::kQ5_K, jvllm::kQ4_0x16, jvllm::kQ4_1x16}) formats |= 1 << f;
#endif
#if defined(__AVX2__)
  for (int f : {jvllm::kQ4_0x8, jvllm::kQ4_1x8}) formats |= 1 << f;
#endif
  return formats;
}
