// Products of a few float32 rows with a bfloat16 weight matrix, as an XLA FFI custom call for XLA CPU: a float
// checkpoint's decode steps of 1-4 token rows, which would otherwise read float32 weights or take XLA CPU's bf16
// dots (one row ~10x slower than a float32 one; 2-4 rows slower than this kernel). Each weight is widened to
// float32 exactly (its bits shifted up) and multiplied with x in float32, so the product is x times the
// bf16-rounded weights with float32 sums. The weights are [N, K] (one row per output: a dot over contiguous K per
// output) or [K, N] (a Linear kernel [in, out]: each input's weights added into every output); the work is split
// over the kernels' helper threads, by outputs for [N, K] and, with AVX-512, by slices of K for [K, N]. With
// AVX-512 a 64-byte load of 32 weights gives two float vectors without shuffles: the even weights (each 32-bit lane
// shifted left by 16) and the odd ones (its low half cleared), multiplied with x's even and odd elements; every row
// of x meets a weight vector once it is loaded.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "run_items.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JVLLM_BF16_ROWS_AVX512 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 4;          // rows of x a call takes
constexpr int64_t kOutputsPerItem = 16;  // [N, K] weights: an item's outputs are a multiple of this
constexpr int64_t kColumnsPerItem = 128; // [K, N] weights without AVX-512: output columns per item
// [N, K] weights: the longest K read one output at a time for one row of x, four for 2-4 rows (x's 12 KB a row stays
// in L1 beside the weight streams); longer K read eight outputs at a time, which a 32 KB L1 (Zen 4) reads faster from
// K = 4,096 on, and slower at 2,048 for one row
constexpr int64_t kMaxOneStreamK = 3072;

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

// Outputs an item of [N, K] weights: 1-4 items a thread (BalancedUnits), whole multiples of kOutputsPerItem, so that
// each thread reads long runs of consecutive weight rows, which the prefetchers follow; small items taken in turn by
// the threads would break those runs every few KB (docs/design/bf16_weights.md).
int64_t OutputsPerItem(int64_t n) {
  const int64_t threads = jvllm::HelperPool::Get().num_helpers() + 1;
  return jvllm::BalancedUnits((n + kOutputsPerItem - 1) / kOutputsPerItem, threads) * kOutputsPerItem;
}

// y = x . w^T with w [N, K]: a dot over contiguous K per output, per_item outputs an item.
struct RowsTimesOutIn : Operands {
  int64_t per_item;

  int64_t num_items() const { return (n + per_item - 1) / per_item; }

  void Run(int64_t item) const {
    const int64_t end = std::min(n, (item + 1) * per_item);
    for (int64_t j = item * per_item; j < end; ++j) {
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

#if JVLLM_BF16_ROWS_AVX512
inline __m512 EvenWeights(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 OddWeights(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __mmask32 FirstWords(int64_t count) { return (__mmask32{1} << count) - 1; }  // count < 32

// Operands of [N, K] weights with `split` holding each row of x as [even elements, odd elements], each half
// `padded` / 2 long (K rounded up to 32, zeros past K), so the same 16 lanes of a weight vector and of x's halves
// pair up; per_item outputs an item (OutputsPerItem).
struct SplitOutInOperands : Operands {
  const float* split;
  int64_t padded;
  int64_t per_item;  // outputs an item

  int64_t num_items() const { return (n + per_item - 1) / per_item; }

  // Output j's 32 weights from i (zeros past K).
  __m512i Weights(int64_t j, int64_t i) const {
    const uint16_t* p = w + j * k + i;
    return i + 32 <= k ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(FirstWords(k - i), p);
  }
};

// y = x . w^T with w [N, K] for one row of x, T outputs at a time, even and odd sums apart (so the bits do not depend
// on T). One output at a time a thread reads one stream of weights, the fastest while x (K float32) stays in the
// 32-48 KB L1 beside it; for longer K (x from L2 for every output) eight outputs at a time, each x load met by eight
// weight streams, read faster (kMaxOneStreamK; docs/design/bf16_weights.md).
template <int T>
struct SplitRowTimesOutIn : SplitOutInOperands {
  void Run(int64_t item) const {
    const int64_t end = std::min(n, (item + 1) * per_item);
    for (int64_t j0 = item * per_item; j0 < end; j0 += T) {
      const int outputs = static_cast<int>(std::min<int64_t>(T, end - j0));
      __m512 even_sums[T], odd_sums[T];
      for (int t = 0; t < T; ++t) even_sums[t] = odd_sums[t] = _mm512_setzero_ps();
      for (int64_t i = 0; i < padded; i += 32) {
        const __m512 even_x = _mm512_loadu_ps(split + i / 2), odd_x = _mm512_loadu_ps(split + padded / 2 + i / 2);
        for (int t = 0; t < outputs; ++t) {
          const __m512i v = Weights(j0 + t, i);
          even_sums[t] = _mm512_fmadd_ps(EvenWeights(v), even_x, even_sums[t]);
          odd_sums[t] = _mm512_fmadd_ps(OddWeights(v), odd_x, odd_sums[t]);
        }
      }
      for (int t = 0; t < outputs; ++t) y[j0 + t] = _mm512_reduce_add_ps(_mm512_add_ps(even_sums[t], odd_sums[t]));
    }
  }
};

// The same for M = 2-4 rows of x (`split` [M, padded]): T outputs at a time (4, or 8 for K over kMaxOneStreamK, where
// x's rows no longer stay in L1), each 64-byte load of an output's weights met by every row.
template <int M, int T>
struct SplitRowsTimesOutIn : SplitOutInOperands {
  // Outputs j0 .. j0 + U - 1; U is known when compiled, so that the sums stay in registers (a count known only at
  // run time keeps them in memory, at ~2-3x the time: docs/design/bf16_weights.md).
  template <int U>
  void Outputs(int64_t j0) const {
    __m512 sums[U][M];
    for (int t = 0; t < U; ++t)
      for (int r = 0; r < M; ++r) sums[t][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < padded; i += 32) {
      __m512 even_x[M], odd_x[M];
      for (int r = 0; r < M; ++r) {
        even_x[r] = _mm512_loadu_ps(split + r * padded + i / 2);
        odd_x[r] = _mm512_loadu_ps(split + r * padded + padded / 2 + i / 2);
      }
      for (int t = 0; t < U; ++t) {
        const __m512i v = Weights(j0 + t, i);
        const __m512 even = EvenWeights(v), odd = OddWeights(v);
        for (int r = 0; r < M; ++r) {
          sums[t][r] = _mm512_fmadd_ps(odd, odd_x[r], _mm512_fmadd_ps(even, even_x[r], sums[t][r]));
        }
      }
    }
    for (int t = 0; t < U; ++t)
      for (int r = 0; r < M; ++r) y[r * n + j0 + t] = _mm512_reduce_add_ps(sums[t][r]);
  }

  void Run(int64_t item) const {
    const int64_t end = std::min(n, (item + 1) * per_item);
    int64_t j = item * per_item;
    for (; j + T <= end; j += T) Outputs<T>(j);
    for (; j < end; ++j) Outputs<1>(j);
  }
};

// y = x . w with w [K, N], items being slices of K: an item reads its weight rows whole and in order, one run of
// memory that the prefetchers follow (items of a few columns of every row would read short pieces a row's length
// apart, which they do not: ~1.4x the time), into its own sums of all N outputs, kept in memory per 32 columns as
// 16 even then 16 odd sums (`partial` [items, M, padded_n]); AddSlices adds the items' sums in item order, so the
// bits do not depend on which thread ran an item.
template <int M>
struct SlicedRowsTimesInOut : Operands {
  // weight rows met per load and store of the sums (8 read the model's products of 2-4 rows ~5-15% faster than 4)
  static constexpr int64_t kRowsPerPass = 8;

  float* partial;
  int64_t padded_n, rows_per_item;

  int64_t num_items() const { return (k + rows_per_item - 1) / rows_per_item; }

  void Run(int64_t item) const {
    const int64_t end = std::min(k, (item + 1) * rows_per_item);
    float* sums = partial + item * M * padded_n;
    int64_t i = item * rows_per_item;
    for (; i + kRowsPerPass <= end; i += kRowsPerPass) Pass<kRowsPerPass>(i, sums);
    for (; i < end; ++i) Pass<1>(i, sums);
  }

  // Adds weight rows i .. i + R - 1 times x's elements i .. i + R - 1 into the sums.
  template <int R>
  void Pass(int64_t i, float* sums) const {
    __m512 xs[R][M];
    for (int p = 0; p < R; ++p)
      for (int r = 0; r < M; ++r) xs[p][r] = _mm512_set1_ps(x[r * k + i + p]);
    for (int64_t c = 0; c < n; c += 32) {
      __m512 even_sums[M], odd_sums[M];
      for (int r = 0; r < M; ++r) {
        even_sums[r] = _mm512_loadu_ps(sums + r * padded_n + c);
        odd_sums[r] = _mm512_loadu_ps(sums + r * padded_n + c + 16);
      }
      for (int p = 0; p < R; ++p) {
        const uint16_t* wp = w + (i + p) * n + c;
        const __m512i v = c + 32 <= n ? _mm512_loadu_si512(wp) : _mm512_maskz_loadu_epi16(FirstWords(n - c), wp);
        const __m512 even = EvenWeights(v), odd = OddWeights(v);
        for (int r = 0; r < M; ++r) {
          even_sums[r] = _mm512_fmadd_ps(even, xs[p][r], even_sums[r]);
          odd_sums[r] = _mm512_fmadd_ps(odd, xs[p][r], odd_sums[r]);
        }
      }
      for (int r = 0; r < M; ++r) {
        _mm512_storeu_ps(sums + r * padded_n + c, even_sums[r]);
        _mm512_storeu_ps(sums + r * padded_n + c + 16, odd_sums[r]);
      }
    }
  }

  // y [M, N] = the sum of the items' sums, each group of 32 columns' even and odd sums interleaved.
  void AddSlices() const {
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const int64_t items = num_items();
    for (int r = 0; r < M; ++r) {
      for (int64_t c = 0; c < n; c += 32) {
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
        for (int64_t item = 0; item < items; ++item) {
          const float* sums = partial + (item * M + r) * padded_n + c;
          even = _mm512_add_ps(even, _mm512_loadu_ps(sums));
          odd = _mm512_add_ps(odd, _mm512_loadu_ps(sums + 16));
        }
        const int64_t left = n - c;
        const __mmask16 first_half = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
        const __mmask16 second_half =
            left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
        float* out = y + r * n + c;
        _mm512_mask_storeu_ps(out, first_half, _mm512_permutex2var_ps(even, low, odd));
        _mm512_mask_storeu_ps(out + 16, second_half, _mm512_permutex2var_ps(even, high, odd));
      }
    }
  }
};

template <int M>
void RunSliced(const Operands& operands) {
  using Work = SlicedRowsTimesInOut<M>;
  const int64_t threads = jvllm::HelperPool::Get().num_helpers() + 1;
  const int64_t passes = (operands.k + Work::kRowsPerPass - 1) / Work::kRowsPerPass;
  const int64_t rows_per_item = jvllm::BalancedUnits(passes, threads) * Work::kRowsPerPass;
  const int64_t padded_n = (operands.n + 31) / 32 * 32;
  std::vector<float> partial(((operands.k + rows_per_item - 1) / rows_per_item) * M * padded_n, 0.0f);
  const Work work{operands, partial.data(), padded_n, rows_per_item};
  jvllm::RunItems(work);
  work.AddSlices();
}

// x [M, K] as each row's even elements then its odd ones, K rounded up to 32 with zeros: [M, padded].
std::vector<float> SplitEvenOdd(const float* x, int64_t m, int64_t k, int64_t padded) {
  std::vector<float> split(m * padded, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) split[r * padded + (i & 1) * (padded / 2) + i / 2] = x[r * k + i];
  return split;
}

template <int M>
void RunSplit(const Operands& operands, bool out_in) {
  if (out_in) {
    const int64_t padded = (operands.k + 31) / 32 * 32, per_item = OutputsPerItem(operands.n);
    const std::vector<float> split = SplitEvenOdd(operands.x, M, operands.k, padded);
    if constexpr (M == 1) {
      if (operands.k <= kMaxOneStreamK) {
        jvllm::RunItems(SplitRowTimesOutIn<1>{{operands, split.data(), padded, per_item}});
      } else {
        jvllm::RunItems(SplitRowTimesOutIn<8>{{operands, split.data(), padded, per_item}});
      }
    } else {
      if (operands.k > kMaxOneStreamK) {
        jvllm::RunItems(SplitRowsTimesOutIn<M, 8>{{operands, split.data(), padded, per_item}});
      } else {
        jvllm::RunItems(SplitRowsTimesOutIn<M, 4>{{operands, split.data(), padded, per_item}});
      }
    }
  } else {
    RunSliced<M>(operands);
  }
}
#endif  // JVLLM_BF16_ROWS_AVX512

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
#if JVLLM_BF16_ROWS_AVX512
  switch (m) {
    case 1: RunSplit<1>(operands, out_in); return ffi::Error::Success();
    case 2: RunSplit<2>(operands, out_in); return ffi::Error::Success();
    case 3: RunSplit<3>(operands, out_in); return ffi::Error::Success();
    case 4: RunSplit<4>(operands, out_in); return ffi::Error::Success();
    default: break;
  }
#endif
  if (out_in) {
    jvllm::RunItems(RowsTimesOutIn{operands, OutputsPerItem(n)});
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

// The most rows of x for which this build's product beats XLA CPU's bf16 dot: all it takes with AVX-512 (2-4 rows
// ~1.5x faster than XLA's on a 2-core Zen 4), one row otherwise (where only that was measured).
extern "C" int64_t JvllmBf16RowsPreferredRows() {
#if JVLLM_BF16_ROWS_AVX512
  return kMaxRows;
#else
  return 1;
#endif
}
