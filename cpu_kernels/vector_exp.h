// exp and SiLU on GCC/Clang vectors of any width (or on one float), from Cephes' single-precision polynomial.
#pragma once

#include <cstdint>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace jvllm {

// exp(r) for r in [-ln2 / 2, ln2 / 2], for a float or a vector of them.
template <typename T>
inline T ExpPolynomial(T r) {
  T p = r * 0.0f + 1.9875691500e-4f;  // (r is finite: the callers clamp x first)
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// floor(t) lane by lane, exactly: one rounding instruction where the vector width has one, else toward zero
// through int32 and down by one where that rounded up (|t| < 2^31 in every caller).
template <typename V, typename I>
inline V FloorVector(V t) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    return __builtin_bit_cast(V, _mm512_roundscale_ps(__builtin_bit_cast(__m512, t), _MM_FROUND_TO_NEG_INF));
  }
#endif
#if defined(__AVX__)
  if constexpr (sizeof(V) == 32) return __builtin_bit_cast(V, _mm256_floor_ps(__builtin_bit_cast(__m256, t)));
#endif
  const V down = __builtin_convertvector(__builtin_convertvector(t, I), V);
  return down > t ? down - 1.0f : down;
}

// exp(x) on a float vector V with int32 vector I of the same lanes (~1 ulp on [-87, 88]; below -87.3 it gives 0,
// above 88.7 exp(88.7)): exp(x) = 2^n exp(r) with n = floor(x / ln2 + 1/2).
template <typename V, typename I>
inline V ExpVector(V x) {
  const auto underflow = x < -87.3f;
  x = x < -87.3f ? V{} - 87.3f : (x > 88.7f ? V{} + 88.7f : x);
  const V t = x * 1.44269504088896341f + 0.5f;
  const V n = FloorVector<V, I>(t);
  const V p = ExpPolynomial(x - n * 0.693359375f + n * 2.12194440e-4f);
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  const V result = p * reinterpret_cast<const V&>(bits);
  return underflow ? V{} : result;
}

// silu(x) = x / (1 + exp(-x)) (jax.nn.silu, transformers' SiLU), lane by lane.
template <typename V, typename I>
inline V SiluVector(V x) {
  return x / (1.0f + ExpVector<V, I>(-x));
}

#if defined(__AVX512F__)
// silu on one 512-bit vector of 16 floats (the tiled gated products' epilogue): SiluVector's exp(-x) with AVX-512's
// rounding and power-of-two scaling, and the division as a reciprocal estimate refined by one Newton step (~1 ulp;
// `vdivps` on 512 bits issues one every ~8 cycles, which held a gated product's epilogue).
inline __m512 Silu512(__m512 v) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), v), _mm512_set1_ps(-87.3f)),
                                 _mm512_set1_ps(88.7f));  // -v, clamped as ExpVector clamps
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  const __m512 e = _mm512_scalef_ps(ExpPolynomial(r), n);  // exp(-v)
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(v, inv);
}
#endif

}  // namespace jvllm
