// GGUF block formats as the quantized matmul reads them: each block of a format holds kWeights consecutive weights of
// one row in kBytes bytes, as kSubs sub-blocks of 32. For each block the kernels read the sub-blocks' scales d[s]
// and constants c[s] once (Scales), then each sub-block's codes as floats (Dequant: w = d[s] * code + c[s]) or, on
// AVX2, as 16-bit integers (Codes16), so that sub-block . x = d[s] * (codes . x) + c[s] * sum(x).
//
//   Q8_0 (32 weights, 34 bytes): d, int8 q[32]                 w = d * q
//   Q4_0 (32, 18): d, qs[16]                                   w = d * (nibble - 8)
//   Q4_1 (32, 20): d, m, qs[16]                                w = d * nibble + m
//     (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble)
//   Q4_K (256, 144): d, dmin, scales[12], qs[128]             w = d * sc[s] * nibble - dmin * mn[s]
//   Q5_K (256, 176): d, dmin, scales[12], qh[32], qs[128]     w = d * sc[s] * (nibble + 16 * bit) - dmin * mn[s]
//     (8 sub-blocks s of 32 with 6-bit sc and mn packed in scales; the 64 weights of sub-blocks 2i, 2i + 1 are the low
//      and high nibbles of qs[32i .. 32i + 32]; Q5_K's fifth bit of weight l of sub-block s is bit s of qh[l])
//   Q6_K (256, 210): ql[128], qh[64], int8 scales[16], d        w = d * scales[t] * (q - 32), q 6 bits
//     (16 groups t of 16; see Q6K::Codes for where the bits of each weight sit)
// d, dmin and m are IEEE halves.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int16_dots.h"

namespace jvllm {

constexpr int kLanes = 8;  // floats per vector (an AVX2 register; half an AVX-512 one)
constexpr int kVecsPerSub = 32 / kLanes;

typedef float V8 __attribute__((vector_size(32)));
typedef float V8Unaligned __attribute__((vector_size(32), aligned(4)));
typedef int32_t I32x8 __attribute__((vector_size(32)));

// 8 bytes -> 8 32-bit integers (zero- or sign-extended). GCC's generic vector conversions scalarize these (and byte
// shifts), so AVX2 builds use its extending loads.
inline I32x8 Widen(const uint8_t* p) {
#if defined(__AVX2__)
  return (I32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  I32x8 out;
  for (int i = 0; i < kLanes; ++i) out[i] = p[i];
  return out;
#endif
}
inline I32x8 WidenSigned(const uint8_t* p) {
#if defined(__AVX2__)
  return (I32x8)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  I32x8 out;
  for (int i = 0; i < kLanes; ++i) out[i] = static_cast<int8_t>(p[i]);
  return out;
#endif
}
inline V8 ToFloat(I32x8 q) { return __builtin_convertvector(q, V8); }

inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// The 6-bit scale and min of sub-block s (0-7) of a Q4_K / Q5_K block, from its 12 packed bytes.
inline void ScaleMinK(const uint8_t* scales, int s, int& sc, int& mn) {
  if (s < 4) {
    sc = scales[s] & 63;
    mn = scales[s + 4] & 63;
  } else {
    sc = (scales[s + 4] & 15) | ((scales[s - 4] >> 6) << 4);
    mn = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
  }
}

struct Q8_0 {
  static constexpr int kWeights = 32, kBytes = 34, kSubs = 1;
  static constexpr int kMaxCode = 128;  // the largest |code| Codes16 gives
  static void Scales(const uint8_t* b, float d[kSubs], float c[kSubs]) {
    d[0] = HalfToFloat(b);
    c[0] = 0.0f;
  }
  static void Dequant(const uint8_t* b, int, float d, float, V8 w[kVecsPerSub]) {
    for (int v = 0; v < kVecsPerSub; ++v) w[v] = ToFloat(WidenSigned(b + 2 + v * kLanes)) * d;
  }
#if defined(__AVX2__)
  static void Codes16(const uint8_t* b, int, __m256i& w0, __m256i& w1) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
  }
#endif
};

// Q4_0 and Q4_1: 16 bytes of nibbles after the header; w = d * nibble + c.
template <int kHeader>
struct Nibbles32 {
  static constexpr int kWeights = 32, kBytes = kHeader + 16, kSubs = 1, kMaxCode = 15;
  static void Scales(const uint8_t* b, float d[kSubs], float c[kSubs]) {
    d[0] = HalfToFloat(b);
    c[0] = kHeader == 2 ? -8.0f * d[0] : HalfToFloat(b + 2);
  }
  static void Dequant(const uint8_t* b, int, float d, float c, V8 w[kVecsPerSub]) {
    for (int half = 0; half < 2; ++half) {
      const I32x8 q = Widen(b + kHeader + half * kLanes);
      w[half] = ToFloat(q & 15) * d + c;
      w[half + 2] = ToFloat(q >> 4) * d + c;
    }
  }
#if defined(__AVX2__)
  static void Codes16(const uint8_t* b, int, __m256i& w0, __m256i& w1) { Nibbles16(b + kHeader, w0, w1); }
#endif
};
using Q4_0 = Nibbles32<2>;
using Q4_1 = Nibbles32<4>;

// Q4_K and Q5_K: sub-block s holds the low (s even) or high (s odd) nibbles of 32 bytes, Q5_K adds bit s of qh.
template <bool kFifthBit>
struct NibblesK {
  static constexpr int kWeights = 256, kBytes = kFifthBit ? 176 : 144, kSubs = 8, kMaxCode = kFifthBit ? 31 : 15;
  static constexpr int kQs = kFifthBit ? 48 : 16;  // where the nibbles start (qh, 32 bytes, at 16)

  static void Scales(const uint8_t* b, float d[kSubs], float c[kSubs]) {
    const float scale = HalfToFloat(b), min_scale = HalfToFloat(b + 2);
    for (int s = 0; s < kSubs; ++s) {
      int sc, mn;
      ScaleMinK(b + 4, s, sc, mn);
      d[s] = scale * static_cast<float>(sc);
      c[s] = -(min_scale * static_cast<float>(mn));
    }
  }
  static void Dequant(const uint8_t* b, int s, float d, float c, V8 w[kVecsPerSub]) {
    const uint8_t* qs = b + kQs + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    for (int v = 0; v < kVecsPerSub; ++v) {
      I32x8 q = (Widen(qs + v * kLanes) >> shift) & 15;
      if (kFifthBit) q |= ((Widen(b + 16 + v * kLanes) >> s) & 1) << 4;
      w[v] = ToFloat(q) * d + c;
    }
  }
#if defined(__AVX2__)
  static void Codes16(const uint8_t* b, int s, __m256i& w0, __m256i& w1) {
    const uint8_t* qs = b + kQs + 32 * (s / 2);
    const __m256i fifteen = _mm256_set1_epi16(15);
    w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
    w0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4 * (s & 1)), fifteen);
    w1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4 * (s & 1)), fifteen);
    if (kFifthBit) {
      const __m256i ones = _mm256_set1_epi16(1);
      const __m256i h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
      const __m256i h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32)));
      w0 = _mm256_or_si256(w0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h0, s), ones), 4));
      w1 = _mm256_or_si256(w1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h1, s), ones), 4));
    }
  }
#endif
};
using Q4_K = NibblesK<false>;
using Q5_K = NibblesK<true>;

// Q6_K: sub-block s = 4h + p (h: which 128 weights, p: 0-3) takes the low (p < 2) or high nibbles of
// ql[64h + 32 (p & 1) ..], bits 2p, 2p + 1 of qh[32h ..] on top, and scales[2s] (its first 16 weights) and
// scales[2s + 1] (the next 16).
struct Q6_K {
  static constexpr int kWeights = 256, kBytes = 210, kSubs = 8;
  static constexpr int kMaxCode = 128 * 32;  // group scale times (q - 32), as Codes16 folds them

  static const uint8_t* Low(const uint8_t* b, int s) { return b + 64 * (s / 4) + 32 * (s & 1); }
  static const uint8_t* High(const uint8_t* b, int s) { return b + 128 + 32 * (s / 4); }
  static const int8_t* GroupScales(const uint8_t* b, int s) { return reinterpret_cast<const int8_t*>(b + 192) + 2 * s; }

  // The int8 group scales are applied with the codes (two groups a sub-block); d is the block's.
  static void Scales(const uint8_t* b, float d[kSubs], float c[kSubs]) {
    const float scale = HalfToFloat(b + 208);
    for (int s = 0; s < kSubs; ++s) {
      d[s] = scale;
      c[s] = 0.0f;
    }
  }
  static void Dequant(const uint8_t* b, int s, float d, float, V8 w[kVecsPerSub]) {
    const int8_t* scales = GroupScales(b, s);
    const int low_shift = (s % 4) < 2 ? 0 : 4, high_shift = 2 * (s % 4);
    for (int v = 0; v < kVecsPerSub; ++v) {
      const I32x8 q = ((Widen(Low(b, s) + v * kLanes) >> low_shift) & 15) |
                      (((Widen(High(b, s) + v * kLanes) >> high_shift) & 3) << 4);
      w[v] = ToFloat(q - 32) * (d * static_cast<float>(scales[v / 2]));
    }
  }
#if defined(__AVX2__)
  // The group scales are folded into the 16-bit codes (|sc * (q - 32)| <= 4096, so pair sums with 15-bit
  // activations stay within 32 bits).
  static void Codes16(const uint8_t* b, int s, __m256i& w0, __m256i& w1) {
    const int8_t* scales = GroupScales(b, s);
    const int low_shift = (s % 4) < 2 ? 0 : 4, high_shift = 2 * (s % 4);
    const __m256i fifteen = _mm256_set1_epi16(15), three = _mm256_set1_epi16(3), bias = _mm256_set1_epi16(32);
    __m256i out[2];
    for (int half = 0; half < 2; ++half) {
      const __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Low(b, s) + 16 * half)));
      const __m256i high =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(High(b, s) + 16 * half)));
      const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, low_shift), fifteen),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, high_shift), three), 4));
      out[half] = _mm256_mullo_epi16(_mm256_sub_epi16(q, bias), _mm256_set1_epi16(scales[half]));
    }
    w0 = out[0];
    w1 = out[1];
  }
#endif
};

// Q8_0, Q4_0 and Q4_1 with the blocks of 8 weight rows interleaved (the projections' layout on AVX2 builds:
// interleaved_products.h). Per group of 8 rows and 32 weights, kBytes * 8 bytes: the 8 rows' d as halves (16
// bytes), Q4_1's 8 m (16 bytes), then chunks of 16 code bytes where chunk q's byte 2r + e is row r's code byte
// 2q + e. Widened to 16-bit words, a chunk holds one weight pair of all 8 rows per nibble (Q4) or byte (Q8): a
// vpmaddwd operand. Pairs(block, p) gives the pairs (2p, 2p + 1) and (16 + 2p, 17 + 2p), p < 8, in both.
struct InterleavedRowsTag {};

template <int kRowsHeader, int kCodeBytes>
struct Interleaved32 : InterleavedRowsTag {
  static constexpr int kWeights = 32, kSubs = 1, kRows = 8;        // kRows weight rows per group
  static constexpr int kBytes = kRowsHeader / kRows + kCodeBytes;  // per row and block, as row-major
  static constexpr int kGroupBytes = kRows * kBytes;               // one block of all 8 rows
  static constexpr int kCodesAt = kRowsHeader;                     // where the chunks of codes start
  static constexpr bool kHasMin = kRowsHeader == 32;               // Q4_1: w = d * code + m
  // Q4_0: w = d * (code - 8), the constant -8 d
  static constexpr float kCodeOffset = kCodeBytes == 16 && !kHasMin ? -8.0f : 0.0f;
  static constexpr int kMaxCode = kCodeBytes == 32 ? 128 : 15;
#if defined(__AVX2__)
  static void Pairs(const uint8_t* block, int p, __m256i& low, __m256i& high) {
    const uint8_t* codes = block + kCodesAt;
    if constexpr (kCodeBytes == 16) {
      Nibbles16(codes + 16 * p, low, high);
    } else {
      low = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * p)));
      high = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * (p + 8))));
    }
  }
#endif
};
using Q8_0x8 = Interleaved32<16, 32>;
using Q4_0x8 = Interleaved32<16, 16>;
using Q4_1x8 = Interleaved32<32, 16>;

template <typename Fmt>
constexpr bool kInterleavedRows = std::is_base_of_v<InterleavedRowsTag, Fmt>;

// Q8_0, Q4_0 and Q4_1 with the blocks of 16 weight rows grouped by 32-bit code words (the projections' layout on
// AVX-512 builds with BF16: word_group_blocks.h). Per group of 16 rows and 32 weights, kBytes * 16 bytes: the 16
// rows' d as halves (32 bytes), Q4_1's 16 m (32 bytes), then per code word t (4 for Q4, 8 for Q8) 64 bytes: row r's
// code bytes 4t, 4t + 2, 4t + 1, 4t + 3 at 4r. One 512-bit load is then word t of all 16 rows, and the 16-bit halves
// of each lane hold the codes of two neighbouring weights: (4t, 4t + 1) and (4t + 2, 4t + 3) per byte (Q8) or
// nibble (Q4), a `vpdpwssd` operand after a mask or a shift.
struct WordGroupsTag {};

template <int kRowsHeader, int kCodeBytes>
struct WordGroups32 : WordGroupsTag {
  static constexpr int kWeights = 32, kSubs = 1, kRows = 16;        // kRows weight rows per group
  static constexpr int kBytes = kRowsHeader / kRows + kCodeBytes;  // per row and block, as row-major
  static constexpr int kGroupBytes = kRows * kBytes;               // one block of all 16 rows
  static constexpr int kCodesAt = kRowsHeader;                     // where the code words start
  static constexpr int kWords = kCodeBytes / 4;                    // code words per row and block
  static constexpr bool kHasMin = kRowsHeader == 64;               // Q4_1: w = d * code + m
  static constexpr bool kSigned = kCodeBytes == 32;                // Q8_0: signed 8-bit codes
  // Q4_0: w = d * (code - 8), the constant -8 d
  static constexpr float kCodeOffset = kCodeBytes == 16 && !kHasMin ? -8.0f : 0.0f;
  static constexpr int kMaxCode = kSigned ? 128 : 15;
};
using Q8_0x16 = WordGroups32<32, 32>;
using Q4_0x16 = WordGroups32<32, 16>;
using Q4_1x16 = WordGroups32<64, 16>;

template <typename Fmt>
constexpr bool kWordGroups = std::is_base_of_v<WordGroupsTag, Fmt>;

enum Format : int64_t {
  kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kQ4_0x8 = 6, kQ4_1x8 = 7, kQ8_0x8 = 8,
  kQ4_0x16 = 9, kQ4_1x16 = 10, kQ8_0x16 = 11
};

}  // namespace jvllm
