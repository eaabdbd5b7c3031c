// Products of a few float32 rows with a bfloat16 weight matrix, as an XLA FFI custom call for XLA CPU: a float
// checkpoint's one-token steps, which would otherwise read float32 weights (XLA CPU multiplies one row by a 16-bit
// matrix ~10x slower than by a float32 one). Each weight is widened to float32 exactly (its bits shifted up) and
// multiplied with x in float32, so the product is x times the bf16-rounded weights with float32 sums. The weights
// are [N, K] (one row per output: a dot over contiguous K per output) or [K, N] (a Linear kernel [in, out]: each
// input's weights added into a block of outputs); outputs are split over the kernels' helper threads.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "run_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 4;          // rows of x a call takes (the callers' one-token steps: 1)
constexpr int64_t kOutputsPerItem = 16;  // [N, K] weights: output rows per item
constexpr int64_t kColumnsPerItem = 128; // [K, N] weights: output columns per item (8 AVX-512 accumulators a row)

inline float Widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// x [M, K] float32, bf16 weights w, y [M, N] float32.
struct Operands {
  const float* x;
  const uint16_t* w;
  float* y;
  int64_t m, n, k;
};

// y = x . w^T with w [N, K]: a dot over contiguous K per output, kOutputsPerItem outputs an item.
struct RowsTimesOutIn : Operands {
  int64_t num_items() const { return (n + kOutputsPerItem - 1) / kOutputsPerItem; }

  void Run(int64_t item) const {
    const int64_t end = std::min(n, (item + 1) * kOutputsPerItem);
    for (int64_t j = item * kOutputsPerItem; j < end; ++j) {
      const uint16_t* wj = w + j * k;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < k; ++i) sum += xr[i] * Widen(wj[i]);
        y[r * n + j] = sum;
      }
    }
  }
};

// y = x . w with w [K, N]: each input's weights added into kColumnsPerItem output columns an item.
struct RowsTimesInOut : Operands {
  int64_t num_items() const { return (n + kColumnsPerItem - 1) / kColumnsPerItem; }

  void Run(int64_t item) const {
    const int64_t first = item * kColumnsPerItem;
    const int64_t width = std::min(n - first, kColumnsPerItem);
    for (int64_t r = 0; r < m; ++r) {
      float sums[kColumnsPerItem] = {};
      const float* xr = x + r * k;
      for (int64_t i = 0; i < k; ++i) {
        const uint16_t* wi = w + i * n + first;
        const float xi = xr[i];
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) sums[c] += xi * Widen(wi[c]);
      }
      std::copy(sums, sums + width, y + r * n + first);
    }
  }
};

ffi::Error Bf16RowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y,
                        bool out_in) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("bf16_rows: x [M, K] and w of rank 2");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = out_in ? wd[0] : wd[1];
  if ((out_in ? wd[1] : wd[0]) != k) return ffi::Error::InvalidArgument("bf16_rows: w does not take x's K");
  if (m > kMaxRows) return ffi::Error::InvalidArgument("bf16_rows: at most 4 rows of x");
  const Operands operands{x.typed_data(), reinterpret_cast<const uint16_t*>(w.typed_data()), y->typed_data(), m, n, k};
  if (out_in) {
    jvllm::RunItems(RowsTimesOutIn{operands});
  } else {
    jvllm::RunItems(RowsTimesInOut{operands});
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmBf16Rows, Bf16RowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("out_in"));

extern "C" int64_t JvllmBf16RowsMaxRows() { return kMaxRows; }
