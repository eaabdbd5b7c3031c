// 8-bit float KV pages (kv_cache_dtype "fp8_e5m2"): the byte format and its exact conversions to bfloat16 rows (the
// prefill tiles' rows) and to float vectors (the float loops'); fp8_attention.h has the bf16 dot products' rows.
//
// An e5m2 value is the top byte of an IEEE half (1 sign, 5 exponent, 2 mantissa bits), so the hardware's half ->
// float conversion reads it exactly once shifted into place; every e5m2 value (subnormals, infinities and NaNs
// included) is a bfloat16 value too, so the float's top half is the exact bfloat16.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_vectors.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jvllm {

// One stored e5m2 byte; its own type so that the kernels' templates tell its pages from others.
struct E5m2 {
  uint8_t bits;
};

// The bfloat16 bits of e5m2 byte b.
inline uint16_t E5m2ToBf16Bits(uint8_t b) {
  const uint16_t sign = static_cast<uint16_t>((b & 0x80) << 8);
  const int exponent = (b >> 2) & 31, mantissa = b & 3;
  if (exponent == 31) return sign | 0x7F80 | (mantissa << 5);  // infinity, NaN
  if (exponent != 0) return sign | ((exponent + 112) << 7) | (mantissa << 5);
  const float value = std::ldexp(static_cast<float>(mantissa), -16);  // subnormal (or zero): mantissa x 2^-16
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  return sign | static_cast<uint16_t>(u >> 16);
}

// dst[i] = the bfloat16 bits of e5m2 value src[i], for i < n: the prefill tiles' rows (their CPUs have AVX-512
// BF16; head sizes a multiple of 32), one bit-exact scalar loop elsewhere.
inline void E5m2ToBf16(const E5m2* src, int64_t n, uint16_t* dst) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  for (; i + 32 <= n; i += 32) {  // 32 values a step: two halves of floats, then one exact rounding to bfloat16
    const __m512i halves = _mm512_slli_epi16(
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i))), 8);
    const __m512 low = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
    const __m512 high = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
    const __m512bh rounded = _mm512_cvtne2ps_pbh(high, low);
    _mm512_storeu_si512(dst + i, reinterpret_cast<const __m512i&>(rounded));
  }
#endif
  for (; i < n; ++i) dst[i] = E5m2ToBf16Bits(bytes[i]);
}

// Whether pages of PoolT hold 8-bit floats.
template <typename PoolT>
constexpr bool kEightBitPages = std::is_same_v<PoolT, E5m2>;

// kLanes e5m2 values -> float32, exactly (the float loops' rows of 8-bit pages, read in place).
inline VF LoadV(const E5m2* p) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(p);
#if defined(__AVX512F__)
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m256i halves = _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);
  const __m512 floats = _mm512_cvtph_ps(halves);
  return reinterpret_cast<const VF&>(floats);
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i halves = _mm_slli_epi16(_mm_cvtepu8_epi16(codes), 8);
  const __m256 floats = _mm256_cvtph_ps(halves);
  return reinterpret_cast<const VF&>(floats);
#else
  VF out;
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t bits = static_cast<uint32_t>(E5m2ToBf16Bits(bytes[i])) << 16;
    std::memcpy(&out[i], &bits, sizeof(bits));
  }
  return out;
#endif
}

}  // namespace jvllm
