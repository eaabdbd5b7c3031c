// Blocks of kBlockKeys key scores in the paged attention (paged_attention.cc): the causal mask, the online softmax
// that turns a block's scores into probabilities, and the scores of query rows against a block of transposed keys.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_vectors.h"

namespace jvllm {

constexpr int kBlockKeys = 64;     // keys per score block
constexpr float kMasked = -1e30f;  // finite: exp() of it underflows to 0 without NaNs

inline float RowMax(const float* scores) {
  VF best = LoadV(scores);
  for (int c = 1; c < kBlockKeys / kLanes; ++c) {
    const VF x = LoadV(scores + c * kLanes);
    best = x > best ? x : best;
  }
  return Max(best);
}

// Causal (and sliding-window, `window` > 0) mask: row r is query (first_pos + r / group); keys past nkeys are
// masked too.
inline void Mask(int64_t first_pos, int64_t group, int64_t key0, int64_t nkeys, int64_t rows, int64_t window,
                 float* scores) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / group;
    float* sr = scores + r * kBlockKeys;
    const int64_t visible_end = std::min<int64_t>(nkeys, pos - key0 + 1);  // keys j < this are <= pos
    const int64_t visible_begin = window > 0 ? std::max<int64_t>(0, pos - window + 1 - key0) : 0;
    for (int64_t j = 0; j < std::min<int64_t>(visible_begin, kBlockKeys); ++j) sr[j] = kMasked;
    for (int64_t j = std::max<int64_t>(visible_end, 0); j < kBlockKeys; ++j) sr[j] = kMasked;
  }
}

// Online softmax over one block of masked scores [rows, kBlockKeys]: scores become probabilities relative to the
// new running max (masked keys exactly 0), denom is updated, rescale[r] is what the old accumulator is scaled by.
inline void Softmax(int64_t rows, float* scores, float* row_max, float* denom, float* rescale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * kBlockKeys;
    const float block_max = RowMax(sr);
    if (block_max <= kMasked) {  // nothing visible in this block for this row
      rescale[r] = 1.0f;
      for (int j = 0; j < kBlockKeys; ++j) sr[j] = 0.0f;
      continue;
    }
    const float new_max = row_max[r] > block_max ? row_max[r] : block_max;
    rescale[r] = VecExp(row_max[r] - new_max);
    VF sums = {};
    for (int c = 0; c < kBlockKeys / kLanes; ++c) {
      const VF probs = VecExp(LoadV(sr + c * kLanes) - new_max);
      StoreV(sr + c * kLanes, probs);
      sums += probs;
    }
    row_max[r] = new_max;
    denom[r] = denom[r] * rescale[r] + Sum(sums);
  }
}

// acc [rows, hd]: row r times rescale[r].
inline void Rescale(float* acc, const float* rescale, int64_t rows, int64_t hd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < hd; c += kLanes) StoreV(acc + r * hd + c, LoadV(acc + r * hd + c) * rescale[r]);
}

// N rows of queries [N, hd] times transposed keys [hd, kBlockKeys] -> scores [N, kBlockKeys], two vectors of keys
// at a time: N x 2 accumulators fit AVX2's 16 registers, where N x a whole block's 8 vectors would not.
template <int N>
inline void ScoreRows(const float* queries, const float* kt, int64_t hd, float* scores) {
  constexpr int kChunks = kBlockKeys / kLanes, kPass = 2;
  for (int c0 = 0; c0 < kChunks; c0 += kPass) {
    VF acc[N][kPass] = {};
    for (int64_t d = 0; d < hd; ++d) {
      VF keys[kPass];
      for (int c = 0; c < kPass; ++c) keys[c] = LoadV(kt + d * kBlockKeys + (c0 + c) * kLanes);
      for (int n = 0; n < N; ++n) {
        const float q = queries[n * hd + d];
        for (int c = 0; c < kPass; ++c) acc[n][c] += q * keys[c];
      }
    }
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < kPass; ++c) StoreV(scores + n * kBlockKeys + (c0 + c) * kLanes, acc[n][c]);
  }
}

}  // namespace jvllm
