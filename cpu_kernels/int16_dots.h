// Integer dot products of GGUF blocks with activations quantized to int16 blocks (AVX2: 16-bit pairs multiplied
// and summed into 32 bits), for steps of few rows (here) and, with the quantizer below, for large ones
// (int16_tiles.h): about half the instructions of dequantizing the weights to float. With 15 bits per activation
// (one scale per block of 32) the products stay within ~3e-5 of float32's, so
// greedy tokens follow the float32 path; llama.cpp's 8-bit activations (a third fewer instructions again) moved
// them within 32 tokens on 3 of 4 prompts of the embedded model.
#pragma once

// 1 where this build multiplies the 16-bit code tiles 512 bits at a time (int16_tiles.h), which also moves the
// row counts at which the product's paths meet (quantized_matmul.cc).
// Defined on every build (0 without AVX2) since other headers test it.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define JVLLM_INT16_512 1
#else
#define JVLLM_INT16_512 0
#endif

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "line_aligned.h"

namespace jvllm {

// Rows of x in blocks of 32: q = round(x / d) in [-limit, limit] with d = max|x| / limit, and s = d * sum(q).
struct Int16Rows {
  std::vector<int16_t> q;  // [M, K]
  std::vector<float> d;    // [M, K / 32]
  std::vector<float> s;    // [M, K / 32]

  void Quantize(const float* x, int64_t m, int64_t k, int32_t limit = 32767) {
    const int64_t blocks = k / 32;
    GrowTo(q, static_cast<size_t>(m * k));
    GrowTo(d, static_cast<size_t>(m * blocks));
    GrowTo(s, static_cast<size_t>(m * blocks));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < m * blocks; ++b) {
      const float* src = x + b * 32;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float max_abs = _mm_cvtss_f32(m4);
      const __m256 inverse = _mm256_set1_ps(max_abs > 0.0f ? static_cast<float>(limit) / max_abs : 0.0f);
      __m256i ints[4];
      __m256i total = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        ints[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_ROUND_NEAREST));
        total = _mm256_add_epi32(total, ints[i]);
      }
      // pack 2 x 8 int32 -> 16 int16 twice (the packs work within 128-bit lanes; the permute restores the order)
      const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
      int16_t* dst = q.data() + b * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi32(ints[0], ints[1]), order));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi32(ints[2], ints[3]), order));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
      const float scale = max_abs / static_cast<float>(limit);
      d[b] = scale;
      s[b] = scale * static_cast<float>(_mm_cvtsi128_si32(t));
    }
  }

  // q, d and s again by groups of kRowGroup rows (0 past the last row), so that one pointer reaches a whole group
  // and one vector operation scales a block for it (the row path): group_q [groups, K / 32, kRowGroup, 32],
  // group_d and group_s [groups, K / 32, kRowGroup] (lane i: row g * kRowGroup + i).
  static constexpr int64_t kRowGroup = 8;
  std::vector<int16_t> group_q;
  std::vector<float> group_d, group_s;

  void GroupRows(int64_t m, int64_t k) {
    const int64_t blocks = k / 32, groups = (m + kRowGroup - 1) / kRowGroup;
    group_q.assign(static_cast<size_t>(groups * blocks * kRowGroup * 32), 0);
    group_d.assign(static_cast<size_t>(groups * blocks * kRowGroup), 0.0f);
    group_s.assign(group_d.size(), 0.0f);
    for (int64_t row = 0; row < m; ++row) {
      const int64_t base = row / kRowGroup * blocks * kRowGroup + row % kRowGroup;
      for (int64_t b = 0; b < blocks; ++b) {
        std::memcpy(group_q.data() + (base + b * kRowGroup) * 32, q.data() + (row * blocks + b) * 32, 64);
        group_d[base + b * kRowGroup] = d[row * blocks + b];
        group_s[base + b * kRowGroup] = s[row * blocks + b];
      }
    }
  }
};

inline float HorizontalSum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// sums + the pairwise products of w and x (16-bit pairs summed into each 32-bit lane): one VNNI `vpdpwssd` where
// the CPU has it (AVX-512 VNNI or AVX-VNNI), else `vpmaddwd` + `vpaddd`.
inline __m256i AddPairProducts(__m256i sums, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(sums, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(sums, w, x);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(w, x));
#endif
}

#if JVLLM_INT16_512
// AddPairProducts on 512-bit vectors.
inline __m512i AddPairProducts(__m512i sums, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sums, w, x);
#else
  return _mm512_add_epi32(sums, _mm512_madd_epi16(w, x));
#endif
}

inline void KeepInRegister(__m512i& v) { __asm__("" : "+v"(v)); }

// The invariant path (invariant_products.h, amx_block_sums.h) asks for the next group's or chunk's weights while it
// works; the first group or chunk of a thread's range has nothing before it to ask, so it asks for its own weights
// this many blocks ahead of the work.
constexpr int kColdAheadBlocks = 2;

// The invariant path's float chain (invariant_products.h): one block's term added to 16 outputs' sums at `at`,
// f += c * xs; f += float(total) * (d * xd), the same operations on every path that takes it.
template <bool kConstants>
inline void AddBlockTerm(float* at, __m512i total, __m512 d, __m512 c, float xd, float xs) {
  __m512 f = _mm512_loadu_ps(at);
  if constexpr (kConstants) f = _mm512_fmadd_ps(c, _mm512_set1_ps(xs), f);
  const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd));
  _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, f));
}
#endif

// An empty asm that says v is read and written in a vector register, so the compiler keeps a running sum there
// (32 registers with AVX-512, else 16).
inline void KeepInRegister(__m256i& v) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(v));
#else
  __asm__("" : "+x"(v));
#endif
}

// 16-bit weights (elements 0-15, 16-31) . 32 activations -> acc += (their dot product) * scale (in every lane).
inline void Accumulate(__m256i w0, __m256i w1, const int16_t* x, __m256 scale, __m256& acc) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  const __m256i sums = AddPairProducts(_mm256_madd_epi16(w0, x0), w1, x1);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}

// 16 bytes of nibbles -> the low nibbles (elements 0-15) and the high ones (16-31) as 16-bit integers: the bytes
// are widened once, and a widened byte shifted right by 4 is its high nibble.
inline void Nibbles16(const uint8_t* qs, __m256i& lo, __m256i& hi) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
  hi = _mm256_srli_epi16(bytes, 4);
}

}  // namespace jvllm

#endif  // __AVX2__
