// 8 x 8 float transposes, for the tiled products' k-major weight tiles and the attention's transposed keys.
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

}  // namespace jvllm
