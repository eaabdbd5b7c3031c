// The per-thread scratch space of paged attention's work items (attention_work.h, direct_attention.h).
#pragma once

#include <cstdint>
#include <vector>

#include "attention_blocks.h"
#include "bf16_attention.h"
#include "page_view.h"

namespace jvllm {

// Per-thread scratch space, sized on first use.
struct AttentionScratch {
  std::vector<float> queries;  // [rows, head_dim], scaled
  std::vector<float> keys_t;   // [head_dim, kBlockKeys]
  std::vector<float> scores;   // [rows, kBlockKeys]
  std::vector<float> acc;      // [rows, head_dim]
  std::vector<float> row_max, denom, rescale;
  std::vector<float> values;   // [kBlockKeys, head_dim] (bfloat16 pools: converted)
  std::vector<const float*> value_rows;  // [kBlockKeys] rows of values (or of keys, to transpose)
  std::vector<float> zeros;              // [head_dim] of 0, the rows past a block's keys
  // bf16 pages with bf16 dot products: queries [rows, head_dim] and probabilities [rows, kBlockKeys] split into a
  // bf16 high part and the bf16 rest
  std::vector<uint16_t> queries_hi, queries_lo, probs_hi, probs_lo;
  PrefetchCursor cursor;  // the direct path's (page_view.h)

  void Reserve(int64_t rows, int64_t head_dim) {
    auto grow = [](std::vector<float>& v, size_t n) { if (v.size() < n) v.resize(n); };
    grow(queries, rows * head_dim);
    grow(keys_t, head_dim * kBlockKeys);
    grow(scores, rows * kBlockKeys);
    grow(acc, rows * head_dim);
    grow(row_max, rows);
    grow(denom, rows);
    grow(rescale, rows);
    grow(values, kBlockKeys * head_dim);
    grow(zeros, head_dim);
    if (value_rows.size() < kBlockKeys) value_rows.resize(kBlockKeys);
    if constexpr (kBf16Attention) {
      auto grow16 = [](std::vector<uint16_t>& v, size_t n) { if (v.size() < n) v.resize(n); };
      grow16(queries_hi, rows * head_dim);
      grow16(queries_lo, rows * head_dim);
      grow16(probs_hi, rows * kBlockKeys);
      grow16(probs_lo, rows * kBlockKeys);
    }
  }
};

}  // namespace jvllm
