// A fused projection's rows [T, (H + 2 KVH) hd] -> q and k rotated by RoPE and v, in one pass, as an XLA FFI custom
// call for XLA CPU. XLA runs the rotation of q and of k as fusions of their own (and the copy of v the attention
// call needs as one more), which a prefill step pays as ~3x this pass.
// Rotation as models/rope.py's apply_rotary (the halves of each head's first `rotary` dims): out[i] = x[i] cos[i] -
// x[i + half] sin[i] and out[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half]; dims past `rotary` pass.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "run_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTokensPerItem = 16;

struct RopeRows {
  const float *qkv, *cos, *sin;  // [T, (H + 2 KVH) hd], [T, rotary], [T, rotary]
  float *q, *k, *v;              // [T, H, hd], [T, KVH, hd], [T, KVH, hd]
  int64_t tokens, heads, kv_heads, head_dim, rotary;

  int64_t num_items() const { return (tokens + kTokensPerItem - 1) / kTokensPerItem; }

  void Run(int64_t item) const {
    const int64_t end = std::min(tokens, (item + 1) * kTokensPerItem), width = (heads + 2 * kv_heads) * head_dim;
    for (int64_t t = item * kTokensPerItem; t < end; ++t) {
      const float* row = qkv + t * width;
      const float* c = cos + t * rotary;
      const float* s = sin + t * rotary;
      for (int64_t h = 0; h < heads; ++h) Rotate(row + h * head_dim, c, s, q + (t * heads + h) * head_dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        Rotate(row + (heads + h) * head_dim, c, s, k + (t * kv_heads + h) * head_dim);
      }
      std::memcpy(v + t * kv_heads * head_dim, row + (heads + kv_heads) * head_dim,
                  sizeof(float) * kv_heads * head_dim);
    }
  }

  void Rotate(const float* x, const float* c, const float* s, float* out) const {
    const int64_t half = rotary / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      out[i] = x[i] * c[i] - x[i + half] * s[i];
      out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
    for (int64_t i = rotary; i < head_dim; ++i) out[i] = x[i];
  }
};

ffi::Error RopeQkvImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                       ffi::ResultBuffer<ffi::F32> q, ffi::ResultBuffer<ffi::F32> k, ffi::ResultBuffer<ffi::F32> v,
                       int64_t heads, int64_t kv_heads) {
  const auto xd = qkv.dimensions(), cd = cos.dimensions(), sd = sin.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || sd[0] != cd[0] || sd[1] != cd[1] || cd[0] != xd[0] ||
      heads <= 0 || kv_heads < 0) {
    return ffi::Error::InvalidArgument("rope_qkv: qkv [T, (H + 2 KVH) hd] with cos and sin [T, rotary]");
  }
  const int64_t columns = heads + 2 * kv_heads, head_dim = xd[1] / columns, rotary = cd[1];
  if (head_dim * columns != xd[1] || rotary % 2 != 0 || rotary > head_dim) {
    return ffi::Error::InvalidArgument("rope_qkv: qkv's width is not (H + 2 KVH) hd, or rotary is odd or past hd");
  }
  jvllm::RunItems(RopeRows{qkv.typed_data(), cos.typed_data(), sin.typed_data(), q->typed_data(), k->typed_data(),
                           v->typed_data(), xd[0], heads, kv_heads, head_dim, rotary});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmRopeQkv, RopeQkvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [T, (H + 2 KVH) hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [T, rotary]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [T, rotary]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // q [T, H, hd]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k [T, KVH, hd]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v [T, KVH, hd]
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("kv_heads"));
