// Matrix products with GGUF-quantized weights for XLA CPU, as an XLA FFI custom call:
//   y[M, N] = x[M, K] . W[N, K]^T   (x, y float32; W as its GGUF blocks, row n = whole blocks of one format)
//
// The weights stay in the file's blocks and are unpacked in registers (one row block at a time for a few rows
// of x, or one tile of weight rows into a small float buffer reused by every row of x); activations and
// accumulation stay float32, so the result is the float32 product with the dequantized weights up to summation
// order. Work items are ranges of output rows, shared by the caller and the kernels' helper threads.
//
// The block formats are described in block_formats.h.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_formats.h"
#include "int16_dots.h"
#include "run_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;  // weights per sub-block: the unit the kernels walk a row in
constexpr int64_t kMinRowsPerItem = 16;  // output rows per work item, at least

// Weight rows stream from memory once per step, a few rows at a time: each block is fetched while the same block of
// the rows one group earlier is multiplied (the hardware prefetchers alone leave two thirds of the bandwidth unused).
// A prefetch past the end of the weights is harmless (it never faults).
inline void Prefetch(const uint8_t* p) {
#if defined(__SSE__)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

using jvllm::kLanes;
using jvllm::kVecsPerSub;
using jvllm::V8;
using V8Unaligned = jvllm::V8Unaligned;

inline V8 LoadV(const float* p) { return *reinterpret_cast<const V8Unaligned*>(p); }
inline void StoreV(float* p, V8 x) { *reinterpret_cast<V8Unaligned*>(p) = x; }
inline float Sum(V8 x) {
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += x[i];
  return total;
}

struct Shapes {
  int64_t m, k, n, blocks;  // blocks = k / 32 (sub-blocks of 32 weights a row)
};

// Up to kDirectRows rows of x: each weight block is dequantized in registers and used at once.
constexpr int64_t kDirectRows = 1;
// Otherwise kTileRows weight rows at a time are dequantized into a float tile reused by every panel of kPanelRows
// rows of x (6 x 16: 12 accumulators, two x vectors and a broadcast weight fill AVX2's 16 registers).
constexpr int kTileRows = 6;
constexpr int kPanelRows = 16;

// x [M, K] -> panels [ceil(M / 16), K, 16]: panel p holds rows 16p.. k-major, padded with zero rows.
inline void PackPanels(const float* x, int64_t m, int64_t k, std::vector<float>& out) {
  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  out.assign(static_cast<size_t>(panels * k * kPanelRows), 0.0f);
  for (int64_t row = 0; row < m; ++row) {
    float* dst = out.data() + (row / kPanelRows) * k * kPanelRows + row % kPanelRows;
    const float* src = x + row * k;
    for (int64_t c = 0; c < k; ++c) dst[c * kPanelRows] = src[c];
  }
}

#if defined(__AVX2__)
using Int16Rows = jvllm::Int16Rows;
#else
struct Int16Rows {};
#endif

template <typename Fmt>
class Matmul {
 public:
  // With `xq` (x quantized to int16 blocks), rows are multiplied with integer dot products.
  // With `panels` (x packed by PackPanels), rows are multiplied from dequantized weight tiles.
  Matmul(Shapes sh, const float* x, const uint8_t* w, float* y, const Int16Rows* xq = nullptr,
         const float* panels = nullptr)
      : sh_(sh), x_(x), w_(w), y_(y), xq_(xq), panels_(panels) {}

  // Two contiguous ranges of rows per thread: each thread streams long runs of the weights, and one that started
  // late still finds work.
  int64_t rows_per_item() const {
    const int64_t items = 2 * (jvllm::HelperPool::Get().num_helpers() + 1);
    return std::max<int64_t>(kMinRowsPerItem, ((sh_.n + items - 1) / items + 3) / 4 * 4);
  }
  int64_t num_items() const { return (sh_.n + rows_per_item() - 1) / rows_per_item(); }

  void Run(int64_t item) const {
    const int64_t n0 = item * rows_per_item(), n1 = std::min(sh_.n, n0 + rows_per_item());
#if defined(__AVX2__)
    if (xq_ != nullptr) {
      for (int64_t m = 0; m < sh_.m; m += 4) {
        switch (std::min<int64_t>(4, sh_.m - m)) {
          case 1: IntRange<4, 1>(m, n0, n1); break;
          case 2: IntRange<2, 2>(m, n0, n1); break;
          case 3: IntRange<2, 3>(m, n0, n1); break;
          default: IntRange<2, 4>(m, n0, n1); break;
        }
      }
      return;
    }
#endif
    if (sh_.m <= kDirectRows) {
      for (int64_t m = 0; m < sh_.m; ++m) Direct(m, n0, n1);
    } else {
      Tiled(n0, n1);
    }
  }

 private:
  int64_t blocks_per_row() const { return sh_.k / Fmt::kWeights; }
  const uint8_t* Row(int64_t n) const { return w_ + n * blocks_per_row() * Fmt::kBytes; }
  // Fetches a block (its cache lines) ahead of use.
  static void PrefetchBlock(const uint8_t* block) {
    for (int offset = 0; offset < Fmt::kBytes; offset += 64) Prefetch(block + offset);
  }

#if defined(__AVX2__)
  // Rows [m, m + X) of x (quantized) against weight rows [n0, n1), R weight rows at a time.
  template <int R, int X>
  void IntRange(int64_t m, int64_t n0, int64_t n1) const {
    int64_t n = n0;
    for (; n + R <= n1; n += R) IntRows<R, X>(m, n);
    for (; n < n1; ++n) IntRows<1, X>(m, n);
  }

  // Rows [m, m + X) of x against weight rows [n, n + R): each weight block is unpacked once for the X rows, and
  // the same block of the next R weight rows is fetched meanwhile.
  template <int R, int X>
  void IntRows(int64_t m, int64_t n) const {
    const int64_t k = sh_.k, blocks = sh_.blocks;
    const int16_t* xq = xq_->q.data() + m * k;
    const float* xd = xq_->d.data() + m * blocks;
    const float* xs = xq_->s.data() + m * blocks;
    __m256 acc[R][X];
    float offset[R][X] = {};
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < X; ++i) acc[r][i] = _mm256_setzero_ps();
    }
    for (int64_t block = 0; block < blocks_per_row(); ++block) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* w = Row(n + r) + block * Fmt::kBytes;
        PrefetchBlock(Row(n + R + r) + block * Fmt::kBytes);
        float d[Fmt::kSubs], c[Fmt::kSubs];
        Fmt::Scales(w, d, c);
#pragma GCC unroll 8
        for (int s = 0; s < Fmt::kSubs; ++s) {
          const int64_t b = block * Fmt::kSubs + s;
          __m256i w0, w1;
          Fmt::Codes16(w, s, w0, w1);
          for (int i = 0; i < X; ++i) {
            jvllm::Accumulate(w0, w1, xq + i * k + b * kBlock, d[s] * xd[i * blocks + b], acc[r][i]);
            offset[r][i] += c[s] * xs[i * blocks + b];
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < X; ++i) y_[(m + i) * sh_.n + n + r] = jvllm::HorizontalSum(acc[r][i]) + offset[r][i];
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
        PrefetchBlock(Row(n + R + r) + block * Fmt::kBytes);
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

  // Every row of x against weight rows [n0, n1): kTileRows weight rows at a time are dequantized into a float tile
  // [kTileRows, K], then every panel of kPanelRows rows of x (packed k-major) is multiplied with it: per k, the
  // panel's two vectors of x times each tile row's weight broadcast (an outer product into 12 accumulators).
  void Tiled(int64_t n0, int64_t n1) const {
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>(kTileRows) * sh_.k);
    const int64_t panels = (sh_.m + kPanelRows - 1) / kPanelRows;
    for (int64_t n = n0; n < n1; n += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, n1 - n));
      for (int r = 0; r < rows; ++r) {
        const uint8_t* src = Row(n + r);
        float* dst = tile.data() + r * sh_.k;
        for (int64_t block = 0; block < blocks_per_row(); ++block) {
          const uint8_t* w_block = src + block * Fmt::kBytes;
          PrefetchBlock(Row(n + kTileRows + r) + block * Fmt::kBytes);
          float d[Fmt::kSubs], c[Fmt::kSubs];
          Fmt::Scales(w_block, d, c);
#pragma GCC unroll 8
          for (int s = 0; s < Fmt::kSubs; ++s) {
            V8 w[kVecsPerSub];
            Fmt::Dequant(w_block, s, d[s], c[s], w);
            float* out = dst + (block * Fmt::kSubs + s) * kBlock;
            for (int v = 0; v < kVecsPerSub; ++v) StoreV(out + v * kLanes, w[v]);
          }
        }
      }
      for (int64_t p = 0; p < panels; ++p) {
        if (rows == kTileRows) {
          PanelTimesTile<kTileRows>(tile.data(), p, n);
        } else {
          for (int r = 0; r < rows; ++r) PanelTimesTile<1>(tile.data() + r * sh_.k, p, n + r);
        }
      }
    }
  }

  template <int R>
  void PanelTimesTile(const float* tile, int64_t p, int64_t n) const {
    const int64_t k = sh_.k;
    const float* panel = panels_ + p * k * kPanelRows;  // [K, kPanelRows]
    float out[R][kPanelRows];
#if defined(__AVX2__)
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; ++c) {
      const __m256 x0 = _mm256_loadu_ps(panel + c * kPanelRows), x1 = _mm256_loadu_ps(panel + c * kPanelRows + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(tile + r * k + c);
        acc[r][0] = _mm256_fmadd_ps(w, x0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, x1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out[r], acc[r][0]);
      _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
#else
    V8 acc[R][2] = {};
    for (int64_t c = 0; c < k; ++c) {
      const V8 x0 = LoadV(panel + c * kPanelRows), x1 = LoadV(panel + c * kPanelRows + kLanes);
      for (int r = 0; r < R; ++r) {
        const float w = tile[r * k + c];
        acc[r][0] += w * x0;
        acc[r][1] += w * x1;
      }
    }
    for (int r = 0; r < R; ++r) {
      StoreV(out[r], acc[r][0]);
      StoreV(out[r] + kLanes, acc[r][1]);
    }
#endif
    const int64_t m0 = p * kPanelRows, live = std::min<int64_t>(kPanelRows, sh_.m - m0);
    for (int r = 0; r < R; ++r) {
      for (int64_t i = 0; i < live; ++i) y_[(m0 + i) * sh_.n + n + r] = out[r][i];
    }
  }

  Shapes sh_;
  const float* x_;
  const uint8_t* w_;
  float* y_;
  const Int16Rows* xq_;
  const float* panels_;
};

template <typename Fmt>
ffi::Error Run(Shapes sh, const float* x, const uint8_t* w, float* y, int64_t row_bytes,
               int64_t int16_max_rows) {
  if (sh.k % Fmt::kWeights != 0 || row_bytes != sh.k / Fmt::kWeights * Fmt::kBytes) {
    return ffi::Error::InvalidArgument("quantized_matmul: a weight row must be whole blocks of its format");
  }
#if defined(__AVX2__)
  if (sh.m <= int16_max_rows) {
    thread_local Int16Rows xq;
    xq.Quantize(x, sh.m, sh.k);
    Matmul<Fmt> work(sh, x, w, y, &xq);
    jvllm::RunItems(work);
    return ffi::Error::Success();
  }
#endif
  thread_local std::vector<float> panels;
  if (sh.m > kDirectRows) PackPanels(x, sh.m, sh.k, panels);
  Matmul<Fmt> work(sh, x, w, y, nullptr, panels.data());
  jvllm::RunItems(work);
  return ffi::Error::Success();
}

ffi::Error QuantizedMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                               ffi::ResultBuffer<ffi::F32> y, int64_t format, int64_t int16_max_rows) {
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
    case jvllm::kQ8_0: return Run<jvllm::Q8_0>(sh, xp, wp, yp, wd[1], int16_max_rows);
    case jvllm::kQ4_0: return Run<jvllm::Q4_0>(sh, xp, wp, yp, wd[1], int16_max_rows);
    case jvllm::kQ4_1: return Run<jvllm::Q4_1>(sh, xp, wp, yp, wd[1], int16_max_rows);
    case jvllm::kQ4_K: return Run<jvllm::Q4_K>(sh, xp, wp, yp, wd[1], int16_max_rows);
    case jvllm::kQ5_K: return Run<jvllm::Q5_K>(sh, xp, wp, yp, wd[1], int16_max_rows);
    case jvllm::kQ6_K: return Run<jvllm::Q6_K>(sh, xp, wp, yp, wd[1], int16_max_rows);
    default: return ffi::Error::InvalidArgument("quantized_matmul: unknown format");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmQuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w [N, K / block weights * block bytes]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("int16_max_rows"));
