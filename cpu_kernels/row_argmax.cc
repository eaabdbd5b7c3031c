// The first index of each row's maximum, NaN counting as +inf, in one pass over the rows, as an XLA FFI custom call
// for XLA CPU: greedy sampling's argmax over the vocabulary. jnp's argmax lowers there to a reduction of (value,
// index) pairs that does not vectorize, and the sampler's blocked form of it reads the logits twice (a sum to find
// NaNs and a max); a decode step's logits, written past the caches, come back from memory for each pass.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "xla/ffi/api/ffi.h"
#include "run_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowsPerItem = 4;

typedef float Floats __attribute__((vector_size(kLanes * 4)));
typedef int32_t Ints __attribute__((vector_size(kLanes * 4)));

// Lane l keeps the largest value of the row's entries l, l + 16, ... (the first of equals: a later one must be
// strictly larger) and its index; then the largest of the lanes, the smallest index among equals.
int32_t FirstArgmax(const float* row, int64_t n) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  Floats best = Floats{} - kInf;
  Ints where = Ints{} - 1, index;
  for (int l = 0; l < kLanes; ++l) index[l] = l;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Floats v;
    __builtin_memcpy(&v, row + i, sizeof(v));
    v = v != v ? Floats{} + kInf : v;  // NaN as +inf
    const Ints larger = v > best;
    best = larger ? v : best;
    where = larger ? index : where;
    index += kLanes;
  }
  float top = -kInf;
  int32_t first = -1;
  for (int l = 0; l < kLanes; ++l) {
    if (where[l] >= 0 && (best[l] > top || (best[l] == top && where[l] < first))) top = best[l], first = where[l];
  }
  for (; i < n; ++i) {  // the tail after the last whole vector: later than every lane's entries
    const float v = std::isnan(row[i]) ? kInf : row[i];
    if (v > top) top = v, first = static_cast<int32_t>(i);
  }
  return first < 0 ? 0 : first;  // a row of -inf only: its first entry, as jnp.argmax gives
}

struct ArgmaxRows {
  const float* x;
  int32_t* out;
  int64_t rows, n;

  int64_t num_items() const { return (rows + kRowsPerItem - 1) / kRowsPerItem; }
  void Run(int64_t item) const {
    for (int64_t r = item * kRowsPerItem; r < std::min(rows, (item + 1) * kRowsPerItem); ++r) {
      out[r] = FirstArgmax(x + r * n, n);
    }
  }
};

ffi::Error RowArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] == 0 || xd[1] > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument("row_argmax: x [S, V] with 0 < V < 2^31");
  }
  jvllm::RunItems(ArgmaxRows{x.typed_data(), out->typed_data(), xd[0], xd[1]});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmRowArgmax, RowArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [S, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [S] first index of each row's maximum
