// Float vectors for the CPU attention kernels (GCC/Clang vector extensions): loads of float32 and bfloat16 rows,
// horizontal sums and a vectorised exp.
#pragma once

#include <cmath>
#include <cstdint>

#include "prefetch_line.h"
#include "vector_exp.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace jvllm {

// Vectors of kLanes floats (GCC/Clang vector extensions): one AVX-512 register, or one AVX2 register on machines
// without AVX-512 (16-float vectors there are register pairs, which GCC spills through the stack in loop-carried
// sums).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float VF __attribute__((vector_size(4 * kLanes)));
typedef float VFUnaligned __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef uint16_t U16xL __attribute__((vector_size(2 * kLanes), aligned(2)));
typedef uint32_t U32xL __attribute__((vector_size(4 * kLanes)));

inline VF LoadV(const float* p) { return *reinterpret_cast<const VFUnaligned*>(p); }
inline VF LoadV(const uint16_t* p) {  // bfloat16 bits -> float32
#if defined(__AVX2__) && !defined(__AVX512F__)
  // one `vpmovzxwd` from memory and a shift: GCC makes the generic conversion below two 128-bit widenings, a byte
  // shift and an insert on AVX2, shuffles that take the FMA loops' ports
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16);
  return reinterpret_cast<const VF&>(wide);
#else
  const U32xL wide = __builtin_convertvector(*reinterpret_cast<const U16xL*>(p), U32xL) << 16;
  return reinterpret_cast<const VF&>(wide);
#endif
}
inline void StoreV(float* p, VF x) { *reinterpret_cast<VFUnaligned*>(p) = x; }
// Horizontal sum and maximum of a vector's lanes, as a tree of vector steps.
inline float Sum(VF x) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<const __m512&>(x));
#elif defined(__AVX__)
  const __m256 v = reinterpret_cast<const __m256&>(x);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#else
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += x[i];
  return total;
#endif
}
inline float Max(VF x) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<const __m512&>(x));
#elif defined(__AVX__)
  const __m256 v = reinterpret_cast<const __m256&>(x);
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
#else
  float best = x[0];
  for (int i = 1; i < kLanes; ++i) best = x[i] > best ? x[i] : best;
  return best;
#endif
}

// exp(x) (~1 ulp on [-87, 88]; below -87.3 it gives 0): exp(x) = 2^n exp(r) with n = round(x / ln2).
inline float VecExp(float x) {
  const bool underflow = x < -87.3f;
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float p = ExpPolynomial(x - n * 0.693359375f + n * 2.12194440e-4f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return underflow ? 0.0f : p * __builtin_bit_cast(float, bits);
}

typedef int32_t I32xL __attribute__((vector_size(4 * kLanes)));

// VecExp on a whole vector.
inline VF VecExp(VF x) { return ExpVector<VF, I32xL>(x); }

// Gemma 2's soft cap: cap * tanh(x / cap), with tanh from VecExp.
inline float SoftCap(float x, float cap) {
  const float t = VecExp(-2.0f * std::fabs(x / cap));
  const float tanh_abs = (1.0f - t) / (1.0f + t);
  return cap * std::copysign(tanh_abs, x);
}

inline float Load(const float* p) { return *p; }
inline float Load(const uint16_t* p) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(*p) << 16);
}

}  // namespace jvllm
