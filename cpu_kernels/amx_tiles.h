// bfloat16 products on the AMX tile unit of Intel Xeons since Sapphire Rapids (`tdpbf16ps`: a 16 x 16 tile of
// float sums += 16 rows x 32 bf16 values of x times 16 pairs x 16 columns of weight pairs, 8,192 multiply-adds an
// instruction against AVX-512 BF16's 32). Bf16Tiles' weight tiles ([K / 2, 16] bf16 pairs, the even weight in each
// lane's low half) are the B operand as they lie, 64 bytes a pair row, and x [M, K] in bfloat16, packed 16 rows at a
// time (Bf16Rows' panels: [M / 16, K / 32, 16, 32], each tile 1 KB in one run), the A operand; so only the inner
// product changes: 16 or 32 rows of x against one or two weight tiles, summed in 2-4 tiles and stored into y (or a
// small buffer for Bf16Tiles' epilogue).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define JVLLM_AMX 1
#else
#define JVLLM_AMX 0
#endif

#if JVLLM_AMX
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace jvllm {

constexpr int kAmxRows = 16;   // rows of x in a tile of sums
constexpr int kAmxPairs = 16;  // pairs of weights a tile of x or of weights holds (32 values of K)

// Whether this process may use the tile registers. Linux grants them per process on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA), asked here once, before any thread touches a tile. JVLLM_CPU_AMX=0 keeps
// the AVX-512 BF16 products (to compare the two, or should a kernel refuse the request).
inline bool AmxUsable() {
  static const bool usable = [] {
    const char* setting = std::getenv("JVLLM_CPU_AMX");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// This thread's tiles configured for one product (all eight 16 rows x 64 bytes) and released after it: other code on
// the thread may configure them otherwise, and a released tile state costs nothing to save at a context switch.
class AmxTileScope {
 public:
  // A constant, not built on the stack: GCC 12 drops some stores to a stack copy before `ldtilecfg` reads it.
  AmxTileScope() { _tile_loadconfig(kConfig); }
  ~AmxTileScope() { _tile_release(); }
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;

 private:
  // palette 1; bytes 16-47 each tile's bytes a row (16-bit little-endian), bytes 48-63 its rows
  alignas(64) static constexpr uint8_t kConfig[64] = {
      1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0,
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      kAmxRows, kAmxRows, kAmxRows, kAmxRows, kAmxRows, kAmxRows, kAmxRows, kAmxRows, 0, 0, 0, 0, 0, 0, 0, 0};
};

// sums [16 R, 16 or 32] (rows `sums_stride` floats apart) = R groups of 16 rows of x times pairs [p0, p1) of weight
// tile t0 (sums' columns 0-15) and, when `two`, of t1 (columns 16-31, else not touched); with `add`, plus the sums
// there before. x: the first group's panel (Bf16Rows' panels), the next group's `group_values` later; tiles [K / 2, 16]
// of 32-bit pairs. p0 and p1 - p0 are multiples of kAmxPairs. Tiles 0-3 hold the sums (row tile r, weight tile c:
// 2r + c), 4-5 x, 6-7 the weights.
template <int R>
inline void AmxRowsTimesTiles(const uint16_t* x, int64_t group_values, const uint32_t* t0, const uint32_t* t1,
                              int64_t p0, int64_t p1, bool two, float* sums, int64_t sums_stride, bool add) {
  static_assert(R == 1 || R == 2, "16 or 32 rows");
  const int64_t sums_bytes = sums_stride * 4;
  constexpr int64_t kRowBytes = 64, kTileValues = kAmxRows * 32;
  float* const sums1 = sums + kAmxRows * sums_stride;  // the second row tile's
  if (add) {
    _tile_loadd(0, sums, sums_bytes);
    if (two) _tile_loadd(1, sums + 16, sums_bytes);
    if constexpr (R == 2) {
      _tile_loadd(2, sums1, sums_bytes);
      if (two) _tile_loadd(3, sums1 + 16, sums_bytes);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (R == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t p = p0; p < p1; p += kAmxPairs) {
    const uint16_t* a = x + p / kAmxPairs * kTileValues;
    _tile_loadd(4, a, kRowBytes);
    if constexpr (R == 2) _tile_loadd(5, a + group_values, kRowBytes);
    _tile_loadd(6, t0 + p * 16, kRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (R == 2) _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, t1 + p * 16, kRowBytes);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (R == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, sums_bytes);
  if (two) _tile_stored(1, sums + 16, sums_bytes);
  if constexpr (R == 2) {
    _tile_stored(2, sums1, sums_bytes);
    if (two) _tile_stored(3, sums1 + 16, sums_bytes);
  }
}

}  // namespace jvllm
#endif  // JVLLM_AMX
