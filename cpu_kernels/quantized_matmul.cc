// Matrix products with GGUF-quantized weights for XLA CPU, as an XLA FFI custom call:
//   y[M, N] = x[M, K] . W[N, K]^T   (x, y float32; W as its GGUF blocks, row n = K / 32 blocks of one format)
//
// The weights stay in the file's blocks and are dequantized in registers (one row block at a time for a few rows
// of x, or one tile of weight rows into a small float buffer reused by every row of x); activations and
// accumulation stay float32, so the result is the float32 product with the dequantized weights up to summation
// order. Work items are ranges of output rows, shared by the caller and XLA's intra-op pool.
//
// Formats (32 weights a block, `d`/`m` IEEE half):
//   Q8_0: d, int8 q[32]            w = d * q
//   Q4_0: d, uint8 qs[16]          w = d * (nibble - 8)
//   Q4_1: d, m, uint8 qs[16]       w = d * nibble + m
// where element j < 16 of a block is the low nibble of qs[j] and element j + 16 its high nibble.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "run_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;  // weights per block
constexpr int kLanes = 8;   // floats per vector (an AVX2 register; half an AVX-512 one)
constexpr int kVecsPerBlock = kBlock / kLanes;
constexpr int64_t kRowsPerItem = 32;  // output rows per work item

typedef float V8 __attribute__((vector_size(32)));
typedef float V8Unaligned __attribute__((vector_size(32), aligned(4)));
typedef int32_t I32x8 __attribute__((vector_size(32)));

// 8 bytes -> 8 32-bit integers (zero- or sign-extended). GCC's generic vector conversions scalarize these (and byte
// shifts), so AVX2 builds use its extending loads.
inline I32x8 Widen(const uint8_t* p) {
#if defined(__AVX2__)
  return (I32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  I32x8 out;
  for (int i = 0; i < kLanes; ++i) out[i] = p[i];
  return out;
#endif
}
inline I32x8 WidenSigned(const uint8_t* p) {
#if defined(__AVX2__)
  return (I32x8)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  I32x8 out;
  for (int i = 0; i < kLanes; ++i) out[i] = static_cast<int8_t>(p[i]);
  return out;
#endif
}
inline V8 ToFloat(I32x8 q) { return __builtin_convertvector(q, V8); }

inline V8 LoadV(const float* p) { return *reinterpret_cast<const V8Unaligned*>(p); }
inline void StoreV(float* p, V8 x) { *reinterpret_cast<V8Unaligned*>(p) = x; }
inline float Sum(V8 x) {
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += x[i];
  return total;
}

inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// One block of each format -> 32 floats in four vectors.
struct Q8_0 {
  static constexpr int kBytes = 34;
  static void Dequant(const uint8_t* b, V8 w[kVecsPerBlock]) {
    const float d = HalfToFloat(b);
    for (int v = 0; v < kVecsPerBlock; ++v) {
      w[v] = ToFloat(WidenSigned(b + 2 + v * kLanes)) * d;
    }
  }
};

struct Q4_0 {
  static constexpr int kBytes = 18;
  static void Dequant(const uint8_t* b, V8 w[kVecsPerBlock]) {
    const float d = HalfToFloat(b);
    const float offset = -8.0f * d;
    for (int half = 0; half < 2; ++half) {
      const I32x8 q = Widen(b + 2 + half * kLanes);
      w[half] = ToFloat(q & 15) * d + offset;
      w[half + 2] = ToFloat(q >> 4) * d + offset;
    }
  }
};

struct Q4_1 {
  static constexpr int kBytes = 20;
  static void Dequant(const uint8_t* b, V8 w[kVecsPerBlock]) {
    const float d = HalfToFloat(b), m = HalfToFloat(b + 2);
    for (int half = 0; half < 2; ++half) {
      const I32x8 q = Widen(b + 4 + half * kLanes);
      w[half] = ToFloat(q & 15) * d + m;
      w[half + 2] = ToFloat(q >> 4) * d + m;
    }
  }
};

enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

struct Shapes {
  int64_t m, k, n, blocks;  // blocks = k / 32
};

// Up to kDirectRows rows of x: each weight block is dequantized in registers and used at once.
constexpr int64_t kDirectRows = 1;
// Otherwise kTileRows weight rows at a time are dequantized into a float buffer reused by every row of x.
constexpr int kTileRows = 4;
constexpr int kTileXRows = 2;

template <typename Fmt>
class Matmul {
 public:
  Matmul(Shapes sh, const float* x, const uint8_t* w, float* y) : sh_(sh), x_(x), w_(w), y_(y) {}

  int64_t num_items() const { return (sh_.n + kRowsPerItem - 1) / kRowsPerItem; }

  void Run(int64_t item) const {
    const int64_t n0 = item * kRowsPerItem, n1 = std::min(sh_.n, n0 + kRowsPerItem);
    if (sh_.m <= kDirectRows) {
      for (int64_t m = 0; m < sh_.m; ++m) Direct(m, n0, n1);
    } else {
      Tiled(n0, n1);
    }
  }

 private:
  const uint8_t* Row(int64_t n) const { return w_ + n * sh_.blocks * Fmt::kBytes; }

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
    for (int64_t b = 0; b < sh_.blocks; ++b) {
      V8 xv[kVecsPerBlock];
      for (int v = 0; v < kVecsPerBlock; ++v) xv[v] = LoadV(xr + b * kBlock + v * kLanes);
      for (int r = 0; r < R; ++r) {
        V8 w[kVecsPerBlock];
        Fmt::Dequant(Row(n + r) + b * Fmt::kBytes, w);
        for (int v = 0; v < kVecsPerBlock; ++v) acc[r] += w[v] * xv[v];
      }
    }
    for (int r = 0; r < R; ++r) y_[m * sh_.n + n + r] = Sum(acc[r]);
  }

  // Every row of x against weight rows [n0, n1): kTileRows weight rows dequantized once, then swept.
  void Tiled(int64_t n0, int64_t n1) const {
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>(kTileRows) * sh_.k);
    for (int64_t n = n0; n < n1; n += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, n1 - n));
      for (int r = 0; r < rows; ++r) {
        const uint8_t* src = Row(n + r);
        float* dst = tile.data() + r * sh_.k;
        for (int64_t b = 0; b < sh_.blocks; ++b) {
          V8 w[kVecsPerBlock];
          Fmt::Dequant(src + b * Fmt::kBytes, w);
          for (int v = 0; v < kVecsPerBlock; ++v) StoreV(dst + b * kBlock + v * kLanes, w[v]);
        }
      }
      int64_t m = 0;
      if (rows == kTileRows) {
        for (; m + kTileXRows <= sh_.m; m += kTileXRows) TileDot<kTileRows, kTileXRows>(tile.data(), m, n);
        for (; m < sh_.m; ++m) TileDot<kTileRows, 1>(tile.data(), m, n);
      } else {
        for (int r = 0; r < rows; ++r) {
          for (int64_t mm = 0; mm < sh_.m; ++mm) TileDot<1, 1>(tile.data() + r * sh_.k, mm, n + r);
        }
      }
    }
  }

  template <int R, int X>
  void TileDot(const float* tile, int64_t m, int64_t n) const {
    V8 acc[R][X] = {};
    const int64_t k = sh_.k;
    for (int64_t c = 0; c < k; c += kLanes) {
      V8 xv[X];
      for (int i = 0; i < X; ++i) xv[i] = LoadV(x_ + (m + i) * k + c);
      for (int r = 0; r < R; ++r) {
        const V8 w = LoadV(tile + r * k + c);
        for (int i = 0; i < X; ++i) acc[r][i] += w * xv[i];
      }
    }
    for (int i = 0; i < X; ++i) {
      for (int r = 0; r < R; ++r) y_[(m + i) * sh_.n + n + r] = Sum(acc[r][i]);
    }
  }

  Shapes sh_;
  const float* x_;
  const uint8_t* w_;
  float* y_;
};

template <typename Fmt>
ffi::Error Run(ffi::ThreadPool& pool, Shapes sh, const float* x, const uint8_t* w, float* y, int64_t row_bytes) {
  if (row_bytes != sh.blocks * Fmt::kBytes) {
    return ffi::Error::InvalidArgument("quantized_matmul: a weight row must be K / 32 blocks of its format");
  }
  Matmul<Fmt> work(sh, x, w, y);
  jvllm::RunItems(pool, work);
  return ffi::Error::Success();
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                               ffi::ResultBuffer<ffi::F32> y, int64_t format) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] % kBlock != 0) {
    return ffi::Error::InvalidArgument("quantized_matmul: x [M, K] with K a multiple of 32, w [N, row bytes]");
  }
  const Shapes sh{xd[0], xd[1], wd[0], xd[1] / kBlock};
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  switch (format) {
    case kQ8_0: return Run<Q8_0>(pool, sh, xp, wp, yp, wd[1]);
    case kQ4_0: return Run<Q4_0>(pool, sh, xp, wp, yp, wd[1]);
    case kQ4_1: return Run<Q4_1>(pool, sh, xp, wp, yp, wd[1]);
    default: return ffi::Error::InvalidArgument("quantized_matmul: unknown format");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmQuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w [N, K / 32 * block bytes]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("format"));
