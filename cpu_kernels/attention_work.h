// The attention of a paged attention call's work items (paged_attention.cc holds the XLA FFI handlers): per item,
// blocks of kBlockKeys keys scored, masked and softmaxed online, then their values summed; an item that is one span
// of a sequence's keys leaves its partial sums for MergeSpans. Few query rows (decode rows, a row verifying draft
// tokens) multiply key and value rows as stored (direct_attention.h); prefill blocks transpose each block of keys
// once for all their queries, or over bf16 pages take bf16 tiles (bf16_prefill_attention.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx_decode_attention.h"
#include "attention_blocks.h"
#include "attention_scratch.h"
#include "attention_vectors.h"
#include "bf16_attention.h"
#include "bf16_prefill_attention.h"
#include "direct_attention.h"
#include "few_row_attention.h"
#include "fp8_attention.h"
#include "page_view.h"
#include "transpose.h"

namespace jvllm {

constexpr int kDirectScoreRows = 4;  // up to this many score rows, key rows are multiplied as stored (no transpose)
// Direct path: how far ahead of the work (in key positions) rows are asked for, into L2 (128 positions of keys and
// values of 3 bf16 KV heads of 64 dims are ~100 KB: more than L1 holds).
constexpr int kPrefetchKeys = 128;

// The attention of a call's work items (PageView: its arguments and items), run by RunItems.
template <typename PoolT>
class Attention : public DirectAttention<PoolT> {
  using View = PageView<PoolT>;
  using Direct = DirectAttention<PoolT>;
  using typename View::BlockRows;
  using View::sh_, View::opt_, View::q_, View::k_, View::v_, View::k_pages_, View::v_pages_, View::query_start_,
      View::kv_lens_, View::q_lens_, View::out_, View::item_start_, View::group_start_, View::spans_,
      View::partials_, View::partial_floats_;
  using View::Locate, View::LowestKey, View::PrefetchUntil, View::Prefetch, View::Row, View::PagedBelow,
      View::PointRows;
  using Direct::kBf16Rows, Direct::DirectScores, Direct::DirectValues;
#if JVLLM_AMX
  using Direct::PackAmxQueries, Direct::AmxDirectBlock;
#endif

 public:
  using Direct::Direct;

  // Runs work item `item`; decode rows also ask for the first paged keys and values of item `next` (the next this
  // thread runs, -1: none) as they near their end.
  void RunWithNext(int64_t item, int64_t next) const {
    Attend(Locate(item), next >= 0 ? Locate(next) : AttentionItem{});
  }

  // After every item ran: the outputs of span group `group` (View::num_span_groups) from its items' partial sums,
  // in span order. A span the query sees nothing of (past its position, before its window) adds nothing, and the
  // span holding the running max is taken at weight 1, so a query with one visible span gets the bits of an
  // unspanned item.
  void MergeSpans(int64_t group) const {
    const int64_t s = std::upper_bound(group_start_.begin(), group_start_.end(), group) - group_start_.begin() - 1;
    const int64_t spans = spans_[s], item0 = item_start_[s] + (group - group_start_[s]) * spans;
    const AttentionItem place = Locate(item0);
    const int64_t hd = sh_.head_dim, group_size = sh_.group, rows = place.count * group_size;
    const int64_t heads = place.h1 - place.h0, start = query_start_[s] + place.first, n = heads * rows;
    thread_local std::vector<float> acc;
    if (acc.size() < static_cast<size_t>(hd)) acc.resize(hd);
    for (int64_t r = 0; r < n; ++r) {
      float best = kMasked;
      for (int64_t i = 0; i < spans; ++i) best = std::max(best, partials_[(item0 + i) * partial_floats_ + r]);
      float denom = 0.0f;
      bool any = false;
      for (int64_t i = 0; i < spans; ++i) {
        const float* part = partials_ + (item0 + i) * partial_floats_;
        if (part[n + r] == 0.0f) continue;  // nothing visible in this span
        const float weight = part[r] == best ? 1.0f : VecExp(part[r] - best);
        const float* sums = part + 2 * n + r * hd;
        for (int64_t d = 0; d < hd; ++d) acc[d] = any ? acc[d] + sums[d] * weight : sums[d] * weight;
        denom = any ? denom + part[n + r] * weight : part[n + r] * weight;
        any = true;
      }
      const int64_t h = r / rows, i = (r % rows) / group_size, g = r % group_size;
      float* dst = out_ + ((start + i) * sh_.heads + (place.h0 + h) * group_size + g) * hd;
      const float inv = 1.0f / denom;
      for (int64_t d = 0; d < hd; ++d) dst[d] = any ? acc[d] * inv : 0.0f;  // a query sees its own key at least
    }
  }

 private:

  // Attention of work item `here`; `next` is the item this thread runs after it (s < 0: none).
  void Attend(const AttentionItem& here, const AttentionItem& next) const {
    thread_local AttentionScratch scratch;
    const int64_t s = here.s, h0 = here.h0, h1 = here.h1, first = here.first, count = here.count;
    const int64_t hd = sh_.head_dim, group = sh_.group, rows = count * group, heads = h1 - h0;
    scratch.Reserve(heads * rows, hd);
    float* scores = scratch.scores.data();

    const int64_t cached = kv_lens_[s] - q_lens_[s];
    const int64_t start = query_start_[s] + first;  // flat token of the block's first query
    for (int64_t h = h0; h < h1; ++h) {
      float* queries = scratch.queries.data() + (h - h0) * rows * hd;
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const float* src = q_ + ((start + i) * sh_.heads + h * group + g) * hd;
          float* dst = queries + (i * group + g) * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * opt_.scale;
        }
      }
    }
    std::fill(scratch.acc.begin(), scratch.acc.begin() + heads * rows * hd, 0.0f);
    std::fill(scratch.row_max.begin(), scratch.row_max.begin() + heads * rows, kMasked);
    std::fill(scratch.denom.begin(), scratch.denom.begin() + heads * rows, 0.0f);

    const int64_t first_pos = cached + first, last_pos = cached + first + count - 1;
    const int64_t lowest = LowestKey(here);
    // few queries (decode rows, blocks of up to kDirectQueries) or a sequence of up to direct_queries (a row
    // verifying draft tokens): key rows read as stored
    const bool direct = rows <= kDirectScoreRows || count <= kDirectQueries || q_lens_[s] <= opt_.direct_queries;
    if (direct && !scratch.cursor.In(here)) {
      scratch.cursor = {s, h0, first, here.key_lo, lowest};  // nothing asked for yet: the thread's first item
    }
    const int64_t key_end = std::min(last_pos + 1, here.key_hi);  // past the item's keys
#if JVLLM_BF16_PREFILL
    if constexpr (kBf16Rows) {
      // bf16 (or 8-bit) pages on a CPU with bf16 dot products: prefill blocks of queries in transposed tiles
      if (opt_.bf16_tiles && !direct && hd % kBf16Chunk == 0 && opt_.soft_cap == 0.0f) {
        AttendInTiles(scratch, s, h0, h1, count, cached, start, first_pos, lowest);
        return;
      }
    }
#endif
    // bf16 pages on a CPU with bf16 dot products: the direct loops multiply bf16 pairs (bf16_attention.h); 8-bit
    // pages: their bytes widened to bf16 in registers, times one scaled bf16 part of the queries (fp8_attention.h)
    const bool bf16_dots = kBf16Rows && kBf16Attention && direct && hd % kBf16Chunk == 0;
    if (bf16_dots && kEightBitPages<PoolT>) {
      ScaledToBf16(scratch.queries.data(), heads * rows * hd, scratch.queries_hi.data());
    } else if (bf16_dots) {
      SplitToBf16(scratch.queries.data(), heads * rows * hd, scratch.queries_hi.data(), scratch.queries_lo.data());
    }
#if JVLLM_AMX
    // bf16 dot products on a CPU with AMX: the blocks whose keys are all in the pages take the tile unit
    const bool amx = std::is_same_v<PoolT, uint16_t> && bf16_dots && opt_.soft_cap == 0.0f && AmxUsable();
    thread_local AmxDirectScratch amx_scratch;
    std::optional<AmxTileScope> amx_tiles;
    if (amx) {
      amx_tiles.emplace();
      PackAmxQueries(amx_scratch, scratch, heads, rows);
    }
#endif
    if (!direct) Prefetch(s, h0, h1, cached, lowest, kBlockKeys);
    for (int64_t key0 = lowest; key0 < key_end; key0 += kBlockKeys) {
      const int64_t nkeys = std::min<int64_t>(kBlockKeys, key_end - key0);
      if (direct) {  // few rows (decode): key and value rows read in place, a strip of positions at a time
        // The rows kPrefetchKeys positions ahead of the work (on into the thread's next item) are asked for as it
        // goes, after each head's strip: a loop of loads alone, or loads interleaved with arithmetic, leave the
        // memory system idle much of the time (docs/design/cpu_attention.md, "Decode attention: prefetching ahead of
        // the work").
        int64_t before = 0;
        const auto prefetch = [&](int64_t done) {  // done: of the block's two passes over its nkeys keys
          PrefetchUntil(scratch.cursor, here, key_end, next, key0 + done / 2 + kPrefetchKeys, done - before + 1);
          before = done;
        };
#if JVLLM_AMX
        if constexpr (std::is_same_v<PoolT, uint16_t>) {
          if (amx && AmxDirectBlock(scratch, amx_scratch, s, h0, h1, cached, first_pos, key0, nkeys, rows, prefetch)) {
            continue;
          }
        }
#endif
        DirectScores(scratch, s, h0, h1, cached, key0, nkeys, rows, scratch.queries.data(), bf16_dots, scores,
                     prefetch);
        for (int64_t h = 0; h < heads; ++h) {
          Mask(first_pos, group, key0, nkeys, rows, opt_.sliding_window, scores + h * rows * kBlockKeys);
        }
        Softmax(heads * rows, scores, scratch.row_max.data(), scratch.denom.data(), scratch.rescale.data());
        if (bf16_dots && kEightBitPages<PoolT>) {
          ScaledToBf16(scores, heads * rows * kBlockKeys, scratch.probs_hi.data());
        } else if (bf16_dots) {
          SplitToBf16(scores, heads * rows * kBlockKeys, scratch.probs_hi.data(), scratch.probs_lo.data());
        }
        DirectValues(scratch, s, h0, h1, cached, key0, nkeys, rows, scores,
                     bf16_dots ? scratch.probs_hi.data() : nullptr, scratch.probs_lo.data(), scratch.rescale.data(),
                     scratch.acc.data(), prefetch);
        continue;
      }
      Prefetch(s, h0, h1, cached, key0 + kBlockKeys, std::min<int64_t>(kBlockKeys, last_pos + 1 - key0 - kBlockKeys));
      for (int64_t h = h0; h < h1; ++h) {  // one head at a time: keys transposed, rows x keys by broadcasts
        const int64_t off = (h - h0) * rows;
        Scores(scratch, s, h, cached, key0, nkeys, rows, scratch.queries.data() + off * hd, scores);
        Mask(first_pos, group, key0, nkeys, rows, opt_.sliding_window, scores);
        Softmax(rows, scores, scratch.row_max.data() + off, scratch.denom.data() + off, scratch.rescale.data());
        Values(scratch, s, h, cached, key0, nkeys, rows, scores, scratch.rescale.data(), scratch.acc.data() + off * hd);
      }
    }
    if (here.partial >= 0) {  // one span of several: its sums, for MergeSpans
      const int64_t n = heads * rows;
      float* part = partials_ + here.partial * partial_floats_;
      std::copy(scratch.row_max.begin(), scratch.row_max.begin() + n, part);
      std::copy(scratch.denom.begin(), scratch.denom.begin() + n, part + n);
      std::copy(scratch.acc.begin(), scratch.acc.begin() + n * hd, part + 2 * n);
      return;
    }
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t off = (h - h0) * rows;
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = off + i * group + g;
          const float inv = 1.0f / scratch.denom[r];
          float* dst = out_ + ((start + i) * sh_.heads + h * group + g) * hd;
          const float* a = scratch.acc.data() + r * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = a[d] * inv;
        }
      }
    }
  }

  // Attend for a block of prefill queries over bf16 pages (bf16_prefill_attention.h): heads [h0, h1), `count`
  // queries from flat token `start` at positions first_pos.., their scaled queries in scratch.queries.
#if JVLLM_BF16_PREFILL
  void AttendInTiles(AttentionScratch& scratch, int64_t s, int64_t h0, int64_t h1, int64_t count, int64_t cached,
                     int64_t start, int64_t first_pos, int64_t lowest) const {
    if constexpr (kBf16Rows) {
      const int64_t hd = sh_.head_dim, group = sh_.group;
      const PrefillQueries block{scratch.queries.data(), h1 - h0, count * group, group, hd, first_pos, lowest,
                                 opt_.sliding_window};
      Prefetch(s, h0, h1, cached, lowest, kBlockKeys);
      AttendPrefillQueries(
          block, kBlockKeys,
          [&](int64_t h, int64_t pos, uint16_t* k_buf, uint16_t* v_buf, const uint16_t** key, const uint16_t** value) {
            const float *own_k, *own_v;
            const PoolT* paged_k = Row(k_pages_, k_, s, h0 + h, pos, cached, &own_k);
            const PoolT* paged_v = Row(v_pages_, v_, s, h0 + h, pos, cached, &own_v);
            if (own_k != nullptr) {  // this step's own rows: rounded to bfloat16 (8-bit pages: their values come
              RoundToBf16(own_k, hd, k_buf);  // rounded to the pages' format already)
              RoundToBf16(own_v, hd, v_buf);
              *key = k_buf;
              *value = v_buf;
            } else if constexpr (kEightBitPages<PoolT>) {
              E5m2ToBf16(paged_k, hd, k_buf);
              E5m2ToBf16(paged_v, hd, v_buf);
              *key = k_buf;
              *value = v_buf;
            } else {
              *key = paged_k;
              *value = paged_v;
            }
          },
          [&](int64_t key0, int64_t nkeys) { Prefetch(s, h0, h1, cached, key0, nkeys); },
          [&](int64_t h, int64_t r) { return out_ + ((start + r / group) * sh_.heads + (h0 + h) * group + r % group) * hd; });
    }
  }
#endif

  // One head: scores[r, j] = q_r . key_{key0 + j} (scaled, soft-capped), for j < nkeys. The keys are transposed
  // once into [hd, kBlockKeys] (8 x 8 at a time), then 6 rows x 2 vectors of keys per pass.
  void Scores(AttentionScratch& scratch, int64_t s, int64_t head, int64_t cached, int64_t key0, int64_t nkeys,
              int64_t rows, const float* queries, float* scores) const {
    const int64_t hd = sh_.head_dim;
    float* kt = scratch.keys_t.data();
    const float** krows = scratch.value_rows.data();  // the block's key rows as float32 (past nkeys: zeros)
    for (int64_t j = 0; j < kBlockKeys; ++j) {
      const float* own = scratch.zeros.data();
      const PoolT* paged = j < nkeys ? Row(k_pages_, k_, s, head, key0 + j, cached, &own) : nullptr;
      krows[j] = AsFloat(paged, own, scratch.values.data() + j * hd, hd);
    }
    for (int64_t j = 0; j < kBlockKeys; j += 8) {
      for (int64_t d = 0; d < hd; d += 8) {
        Transpose8([&](int i) { return krows[j + i] + d; }, kt + d * kBlockKeys + j, kBlockKeys);
      }
    }
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) ScoreRows<6>(queries + r * hd, kt, hd, scores + r * kBlockKeys);
    for (; r + 3 <= rows; r += 3) ScoreRows<3>(queries + r * hd, kt, hd, scores + r * kBlockKeys);
    for (; r < rows; ++r) ScoreRows<1>(queries + r * hd, kt, hd, scores + r * kBlockKeys);
    if (opt_.soft_cap > 0.0f) {
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores + r * kBlockKeys;
        for (int64_t j = 0; j < kBlockKeys; ++j) sr[j] = SoftCap(sr[j], opt_.soft_cap);
      }
    }
  }

  // One head: acc[r] = acc[r] * rescale[r] + probs[r] @ values of keys [key0, key0 + nkeys).
  void Values(AttentionScratch& scratch, int64_t s, int64_t head, int64_t cached, int64_t key0, int64_t nkeys,
              int64_t rows, const float* probs, const float* rescale, float* acc) const {
    const int64_t hd = sh_.head_dim;
    const float** vrows = scratch.value_rows.data();
    for (int64_t j = 0; j < nkeys; ++j) {
      const float* own;
      const PoolT* paged = Row(v_pages_, v_, s, head, key0 + j, cached, &own);
      vrows[j] = AsFloat(paged, own, scratch.values.data() + j * hd, hd);
    }
    Rescale(acc, rescale, rows, hd);
    FewRowValues(rows, probs, kBlockKeys, vrows, 0, 0, nkeys, acc, hd);
  }

  // A key or value row [hd] as float32: `own` where the row is not in the pages (paged is null), the page's row in
  // place for float32 pools, else converted into `buffer`.
  static const float* AsFloat(const PoolT* paged, const float* own, float* buffer, int64_t hd) {
    if (paged == nullptr) return own;
    if constexpr (std::is_same_v<PoolT, float>) {
      return paged;
    } else {
      for (int64_t c = 0; c < hd / kLanes; ++c) StoreV(buffer + c * kLanes, LoadV(paged + c * kLanes));
      return buffer;
    }
  }
};

// Attention::MergeSpans as RunItems work: one item per span group.
template <typename Work>
struct SpanMerges {
  const Work& attention;
  int64_t num_items() const { return attention.num_span_groups(); }
  void Run(int64_t group) const { attention.MergeSpans(group); }
};

}  // namespace jvllm
