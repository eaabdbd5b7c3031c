// RMSNorm, and a residual add followed by RMSNorm, in one pass over each row, as XLA FFI custom calls for XLA CPU:
// a decoder layer's `x + delta` and `weight * (x / rms(x))`, which XLA runs as three passes (an add, a reduction
// and a scaling), each over the whole step. Rows are split over the kernels' helper threads in items of 32.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "run_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerItem = 32;

// normed[r] = weight * (s[r] / sqrt(mean(s[r]^2) + eps)) with s = x (+ delta, stored in sum when given), over rows of
// `dim` floats; transformers' order: the row times the reciprocal root first, then the weight.
struct NormRows {
  const float *x, *delta, *weight;
  float *sum, *normed;
  int64_t rows, dim;
  float eps;

  int64_t num_items() const { return (rows + kRowsPerItem - 1) / kRowsPerItem; }

  void Run(int64_t item) const {
    const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t r = item * kRowsPerItem; r < end; ++r) {
      const float* xr = x + r * dim;
      const float* source = xr;
      if (delta != nullptr) {
        const float* dr = delta + r * dim;
        float* sr = sum + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) sr[i] = xr[i] + dr[i];
        source = sr;
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += source[i] * source[i];
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      float* out = normed + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) out[i] = weight[i] * (source[i] * inverse);
    }
  }
};

ffi::Error Check(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& weight, int64_t* rows, int64_t* dim) {
  const auto xd = x.dimensions();
  if (xd.size() == 0 || weight.dimensions().size() != 1 || weight.dimensions()[0] != xd.back()) {
    return ffi::Error::InvalidArgument("rms_norm: x [..., D] with a weight [D]");
  }
  *dim = xd.back();
  *rows = *dim == 0 ? 0 : static_cast<int64_t>(x.element_count()) / *dim;
  return ffi::Error::Success();
}

ffi::Error RmsNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32> normed,
                       float eps) {
  int64_t rows, dim;
  if (ffi::Error error = Check(x, weight, &rows, &dim); error.failure()) return error;
  jvllm::RunItems(NormRows{x.typed_data(), nullptr, weight.typed_data(), nullptr, normed->typed_data(), rows, dim, eps});
  return ffi::Error::Success();
}

ffi::Error AddRmsNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::F32> weight,
                          ffi::ResultBuffer<ffi::F32> sum, ffi::ResultBuffer<ffi::F32> normed, float eps) {
  int64_t rows, dim;
  if (ffi::Error error = Check(x, weight, &rows, &dim); error.failure()) return error;
  if (delta.element_count() != x.element_count()) return ffi::Error::InvalidArgument("add_rms_norm: x and delta differ");
  jvllm::RunItems(NormRows{x.typed_data(), delta.typed_data(), weight.typed_data(), sum->typed_data(),
                           normed->typed_data(), rows, dim, eps});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weight [D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // normed [..., D]
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmAddRmsNorm, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta [..., D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weight [D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x + delta
                                  .Ret<ffi::Buffer<ffi::F32>>()  // its RMSNorm
                                  .Attr<float>("eps"));
