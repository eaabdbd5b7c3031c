// 8 x 8 float transposes, for the tiled products' k-major weight tiles and the attention's transposed keys, and
// 16 x 16 transposes of 32-bit values for the prefill attention's bf16 tiles.
#pragma once

#include <cstdint>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace jvllm {

// dst[j * dst_stride + i] = row(i)[j] for i, j < 8, where row(i) points at row i's first float.
template <typename RowAt>
inline void Transpose8(const RowAt& row, float* dst, int64_t dst_stride) {
#if defined(__AVX__)
  __m256 r[8], pairs[8], quads[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(row(i));
  for (int i = 0; i < 8; i += 2) {  // rows i, i + 1 interleaved: (i0 i+1_0 i1 i+1_1 | i4 ..)
    pairs[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    pairs[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // four rows' columns j and j + 4 gathered per 128-bit lane
    quads[i] = _mm256_shuffle_ps(pairs[i], pairs[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    quads[i + 1] = _mm256_shuffle_ps(pairs[i], pairs[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    quads[i + 2] = _mm256_shuffle_ps(pairs[i + 1], pairs[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    quads[i + 3] = _mm256_shuffle_ps(pairs[i + 1], pairs[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // rows 0-3 from the first group, 4-7 from the second
    _mm256_storeu_ps(dst + j * dst_stride, _mm256_permute2f128_ps(quads[j], quads[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * dst_stride, _mm256_permute2f128_ps(quads[j], quads[j + 4], 0x31));
  }
#else
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) dst[j * dst_stride + i] = row(i)[j];
  }
#endif
}

// dst[j * dst_stride + i] = src[i * src_stride + j] for i, j < 8.
inline void Transpose8x8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  Transpose8([&](int i) { return src + i * src_stride; }, dst, dst_stride);
}

#if defined(__AVX512F__)
// dst[i * dst_stride + j] = src[j * src_stride + i] for i, j < 16: a 16 x 16 transpose of 32-bit values.
inline void Transpose16(const void* src, int64_t src_stride, void* dst, int64_t dst_stride) {
  const auto* in = static_cast<const uint32_t*>(src);
  auto* out = static_cast<uint32_t*>(dst);
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * src_stride);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved by 32 bits, then by 64 bits
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + k] holds, per 128-bit lane l, column 4l + k' of rows 4q..4q+3 (k' = 0, 1, 2, 3 for k = 0, 1, 2, 3):
  // gather the four lanes of each column from the four row quads
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88), d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
    t[k] = _mm512_shuffle_i32x4(a, c, 0x88);       // lanes 0 of quads 0-3: column k
    t[8 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);   // lanes 2: column 8 + k
    t[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);   // lanes 1: column 4 + k
    t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd);  // lanes 3: column 12 + k
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + i * dst_stride, t[i]);
}
#endif

}  // namespace jvllm
