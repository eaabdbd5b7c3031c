// The direct path of paged attention, which attention_work.h takes for few query rows (decode rows, rows verifying
// draft tokens): per block of keys, every head's scores and then its value sums, from key and value rows read where
// they lie, a strip of kStripKeys positions of every head at a time (few_row_attention.h; bf16 dot products over
// bf16 pages: bf16_attention.h; 8-bit pages widened in registers: fp8_attention.h), or on the AMX tile unit
// (amx_decode_attention.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx_decode_attention.h"
#include "attention_blocks.h"
#include "attention_scratch.h"
#include "attention_vectors.h"
#include "bf16_attention.h"
#include "few_row_attention.h"
#include "fp8_attention.h"
#include "page_view.h"

namespace jvllm {

constexpr int kStripKeys = 16;  // keys of every head per strip, so token rows are read in order

// The direct path's blocks over a call's pages (PageView: its arguments); Attention runs them.
template <typename PoolT>
class DirectAttention : public PageView<PoolT> {
 protected:  // not private: Attention's using-declarations of these names reach PageView's members through here
  using View = PageView<PoolT>;
  using typename View::BlockRows;
  using View::sh_, View::opt_, View::k_, View::v_, View::k_pages_, View::v_pages_;
  using View::PagedBelow, View::PointRows;

 public:
  using View::View;

 protected:
  // bfloat16 pages, and 8-bit ones, take the bf16 dot-product loops where the CPU has them
  static constexpr bool kBf16Rows = std::is_same_v<PoolT, uint16_t> || kEightBitPages<PoolT>;

#if JVLLM_AMX
  // The AMX direct path's query operands: per head and pass of up to 8 rows, from scratch's bf16 query parts.
  void PackAmxQueries(AmxDirectScratch& amx, const AttentionScratch& scratch, int64_t heads, int64_t rows) const {
    const int64_t hd = sh_.head_dim, passes = (rows + kAmxQueryRows - 1) / kAmxQueryRows;
    amx.Reserve(heads, rows, hd);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t r0 = pass * kAmxQueryRows, at = (h * rows + r0) * hd;
        PackQueryColumns(scratch.queries_hi.data() + at, scratch.queries_lo.data() + at,
                         std::min(kAmxQueryRows, rows - r0), hd, amx, AmxQueryColumns(amx, h, pass, rows));
      }
    }
  }

  uint32_t* AmxQueryColumns(AmxDirectScratch& amx, int64_t h, int64_t pass, int64_t rows) const {
    const int64_t passes = (rows + kAmxQueryRows - 1) / kAmxQueryRows;
    return amx.query_cols.data() + (h * passes + pass) * sh_.head_dim / 2 * 16;
  }

  // One block of the direct path on the tile unit (amx_decode_attention.h): scores, mask, online softmax and values
  // for every head of [h0, h1), as DirectScores .. DirectValues do with vectors. False (nothing done) where some of
  // the block's keys are not in the pages (this step's own, read from its arguments).
  template <typename AskAhead>
  bool AmxDirectBlock(AttentionScratch& scratch, AmxDirectScratch& amx, int64_t s, int64_t h0, int64_t h1,
                      int64_t cached, int64_t first_pos, int64_t key0, int64_t nkeys, int64_t rows,
                      const AskAhead& prefetch) const {
    BlockRows keys, values;
    const int64_t paged_below = PagedBelow(s, cached);
    PointRows(k_pages_, k_, s, h0, paged_below, key0, nkeys, &keys);
    if (keys.paged < nkeys) return false;
    PointRows(v_pages_, v_, s, h0, paged_below, key0, nkeys, &values);
    const int64_t hd = sh_.head_dim, heads = h1 - h0, token_stride = sh_.kv_heads * hd;
    const int64_t groups = (nkeys + kAmxGroupKeys - 1) / kAmxGroupKeys;
    float* scores = scratch.scores.data();
    const uint16_t* tiles[kAmxBlockGroups];
    int64_t tile_bytes[kAmxBlockGroups];
    auto group_rows = [&](const BlockRows& block, int64_t h) {
      for (int64_t g = 0; g < groups; ++g) {
        uint16_t* staged = reinterpret_cast<uint16_t*>(amx.staged_rows.data()) + g * kAmxGroupKeys * hd;
        tiles[g] = GroupRows(block.pages, h * hd, g * kAmxGroupKeys, nkeys - g * kAmxGroupKeys, token_stride, hd,
                             staged, &tile_bytes[g]);
      }
    };
    for (int64_t h = 0; h < heads; ++h) {
      group_rows(keys, h);
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxQueryRows) {
        AmxBlockScores(groups, tiles, tile_bytes, hd, AmxQueryColumns(amx, h, r0 / kAmxQueryRows, rows),
                       std::min(kAmxQueryRows, rows - r0), amx, scores + (h * rows + r0) * kBlockKeys, kBlockKeys,
                       [&](int64_t g) { if (r0 == 0) prefetch(nkeys * (h * groups + g + 1) / (heads * groups)); });
      }
    }
    const int64_t group_size = sh_.group;
    for (int64_t h = 0; h < heads; ++h) {
      Mask(first_pos, group_size, key0, nkeys, rows, opt_.sliding_window, scores + h * rows * kBlockKeys);
    }
    Softmax(heads * rows, scores, scratch.row_max.data(), scratch.denom.data(), scratch.rescale.data());
    SplitToBf16(scores, heads * rows * kBlockKeys, scratch.probs_hi.data(), scratch.probs_lo.data());
    for (int64_t h = 0; h < heads; ++h) {
      group_rows(values, h);
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxQueryRows) {
        const int64_t at = h * rows + r0;
        AmxBlockValues(groups, tiles, tile_bytes, hd, scratch.probs_hi.data() + at * kBlockKeys,
                       scratch.probs_lo.data() + at * kBlockKeys, kBlockKeys, std::min(kAmxQueryRows, rows - r0),
                       scratch.rescale.data() + at, amx, scratch.acc.data() + at * hd, [&](int64_t g) {
                         if (r0 == 0) prefetch(nkeys + nkeys * (h * groups + g + 1) / (heads * groups));
                       });
      }
    }
    return true;
  }
#endif

  // Every head of [h0, h1): scores[h, r, j] = q_{h,r} . key_{key0 + j, h} (scaled, soft-capped), for j < nkeys. Keys
  // are read once for the head's rows (few_row_attention.h); with `bf16_dots`, the paged ones against the queries'
  // two bf16 parts in scratch (bf16_attention.h). prefetch(done) is called after each head's strip, `done` of the
  // block's 2 x nkeys key passes behind it (this pass: the first nkeys).
  template <typename AskAhead>
  void DirectScores(AttentionScratch& scratch, int64_t s, int64_t h0, int64_t h1, int64_t cached, int64_t key0,
                    int64_t nkeys, int64_t rows, const float* queries, bool bf16_dots, float* scores,
                    const AskAhead& prefetch) const {
    const int64_t hd = sh_.head_dim, heads = h1 - h0;
    BlockRows keys;
    PointRows(k_pages_, k_, s, h0, PagedBelow(s, cached), key0, nkeys, &keys);
    for (int64_t j0 = 0; j0 < nkeys; j0 += kStripKeys) {
      const int64_t j1 = std::min<int64_t>(nkeys, j0 + kStripKeys), paged = std::clamp(keys.paged, j0, j1);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = queries + h * rows * hd;
        float* sh = scores + h * rows * kBlockKeys;
        if constexpr (kEightBitPages<PoolT>) {
          if (bf16_dots) {
            Bf16FewRowDots<1>(rows, scratch.queries_hi.data() + h * rows * hd, nullptr, hd, keys.pages, h * hd, j0,
                              paged, sh, kBlockKeys);
          } else {
            FewRowDots(rows, qh, hd, keys.pages, h * hd, j0, paged, sh, kBlockKeys);
          }
        } else if constexpr (std::is_same_v<PoolT, uint16_t>) {
          if (bf16_dots) {
            const int64_t at = h * rows * hd;
            Bf16FewRowDots(rows, scratch.queries_hi.data() + at, scratch.queries_lo.data() + at, hd, keys.pages,
                           h * hd, j0, paged, sh, kBlockKeys);
          } else {
            FewRowDots(rows, qh, hd, keys.pages, h * hd, j0, paged, sh, kBlockKeys);
          }
        } else {
          FewRowDots(rows, qh, hd, keys.pages, h * hd, j0, paged, sh, kBlockKeys);
        }
        FewRowDots(rows, qh, hd, keys.own, h * hd, paged, j1, sh, kBlockKeys);
        prefetch(j0 + (j1 - j0) * (h + 1) / heads);
      }
    }
    for (int64_t r = 0; r < heads * rows; ++r) {
      float* sr = scores + r * kBlockKeys;
      for (int64_t j = nkeys; j < kBlockKeys; ++j) sr[j] = 0.0f;
      if (opt_.soft_cap > 0.0f) {
        for (int64_t j = 0; j < kBlockKeys; ++j) sr[j] = SoftCap(sr[j], opt_.soft_cap);
      }
    }
  }

  // acc[h, r] = acc[h, r] * rescale[h, r] + sum_j probs[h, r, j] * value_{key0 + j, h} for every head of [h0, h1),
  // values as rows (paged ones in place); paged values times the probabilities' two bf16 parts where `probs_hi`
  // is given. prefetch(done) as in DirectScores (this pass: the second nkeys).
  template <typename AskAhead>
  void DirectValues(AttentionScratch& scratch, int64_t s, int64_t h0, int64_t h1, int64_t cached, int64_t key0,
                    int64_t nkeys, int64_t rows, const float* probs, const uint16_t* probs_hi, const uint16_t* probs_lo,
                    const float* rescale, float* acc, const AskAhead& prefetch) const {
    const int64_t hd = sh_.head_dim;
    BlockRows values;
    PointRows(v_pages_, v_, s, h0, PagedBelow(s, cached), key0, nkeys, &values);
    Rescale(acc, rescale, (h1 - h0) * rows, hd);
    for (int64_t j0 = 0; j0 < nkeys; j0 += kStripKeys) {
      const int64_t j1 = std::min<int64_t>(nkeys, j0 + kStripKeys), paged = std::clamp(values.paged, j0, j1);
      for (int64_t h = 0; h < h1 - h0; ++h) {
        const float* ph = probs + h * rows * kBlockKeys;
        float* ah = acc + h * rows * hd;
        if constexpr (kEightBitPages<PoolT>) {
          if (probs_hi != nullptr) {  // the probabilities' one scaled part
            Bf16FewRowValues<1>(rows, probs_hi + h * rows * kBlockKeys, nullptr, kBlockKeys, values.pages, h * hd,
                                j0, paged, ah, hd);
          } else {
            FewRowValues(rows, ph, kBlockKeys, values.pages, h * hd, j0, paged, ah, hd);
          }
        } else if constexpr (std::is_same_v<PoolT, uint16_t>) {
          if (probs_hi != nullptr) {
            const int64_t at = h * rows * kBlockKeys;
            Bf16FewRowValues(rows, probs_hi + at, probs_lo + at, kBlockKeys, values.pages, h * hd, j0, paged, ah, hd);
          } else {
            FewRowValues(rows, ph, kBlockKeys, values.pages, h * hd, j0, paged, ah, hd);
          }
        } else {
          FewRowValues(rows, ph, kBlockKeys, values.pages, h * hd, j0, paged, ah, hd);
        }
        FewRowValues(rows, ph, kBlockKeys, values.own, h * hd, paged, j1, ah, hd);
        prefetch(nkeys + j0 + (j1 - j0) * (h + 1) / (h1 - h0));
      }
    }
  }
};

}  // namespace jvllm
