// What a paged attention call (paged_attention.cc) reads and how its work splits: the step's shapes and options,
// where each key row of a sequence lives (its pages below the cached length, this step's own K/V above), how the
// memory system is asked for rows ahead of the work, and the work items (sequence, KV heads, block of queries, span
// of keys).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_blocks.h"
#include "attention_vectors.h"
#include "run_items.h"

namespace jvllm {

constexpr int kBlockQueries = 32;  // queries per work item: each block of keys is transposed once for them all
// Blocks of up to this many queries (a decode row verifying draft tokens) read key rows as stored, without a
// transpose (attention_work.h); a lone sequence's such queries go in two halves where its keys come in few spans
// (PageView's constructor). A call may raise it (AttentionOptions::direct_queries) so that longer runs of draft
// tokens get decode rows' bits too.
constexpr int kDirectQueries = 8;
// A sequence of that few queries (decode rows, rows verifying drafts) attends its keys in spans of this many
// positions, one work item each (all its KV heads), whose partial softmax sums are merged after
// (Attention::MergeSpans): a lone sequence's long context then keeps every thread busy reading whole token rows of
// the pages in order (one item per KV head would leave a thread idle with 3 heads on 2 threads, and read every
// third part of each row). Span edges are fixed positions, so a query's result does not depend on the queries
// with it.
constexpr int64_t kSpanKeys = 256;

struct AttentionShapes {
  int64_t tokens, heads, kv_heads, head_dim, group, page_size, pages_per_seq, seqs;
};

struct AttentionOptions {
  float scale;
  int64_t sliding_window;  // 0: none
  float soft_cap;          // 0: none
  bool bf16_tiles;         // prefill blocks over bf16 pages may round queries and probabilities to bf16
  // The step's own K/V are in the pages already (the write variant): the few-query loops read them there, so a query
  // sees every key as the pages hold it, whether its step ran it alone or with draft tokens after it.
  bool own_in_pages;
  // A sequence of up to this many queries takes the direct loops (at least kDirectQueries; at most kBlockQueries).
  int64_t direct_queries = kDirectQueries;
};

// What a work item attends: queries [first, first + count) of sequence s, KV heads [h0, h1), keys from key_lo
// (below: none) up to key_hi (exclusive; the queries' own positions bound them too). `partial` >= 0: one span of
// several, whose sums go to the call's partial sums at that index (merged after) instead of the output.
struct AttentionItem {
  int64_t s = -1, h0 = 0, h1 = 0, first = 0, count = 0;
  int64_t key_lo = 0, key_hi = INT64_MAX, partial = -1;
};

// The direct path's prefetch cursor: the next key position whose paged rows are asked for, in work item (sequence
// s, heads from h0, queries from first, keys from key_lo): the item being attended, or the one its thread runs next.
struct PrefetchCursor {
  int64_t s = -1, h0 = 0, first = 0, key_lo = 0, pos = 0;

  bool In(const AttentionItem& item) const {
    return s == item.s && h0 == item.h0 && first == item.first && key_lo == item.key_lo;
  }
};

// A call's arguments (pages of PoolT: float, bfloat16 bits or e5m2 bytes) and its work items.
template <typename PoolT>
class PageView {
 public:
  PageView(const AttentionShapes& sh, const AttentionOptions& opt, const float* q, const float* k, const float* v,
           const PoolT* k_pages, const PoolT* v_pages, const int32_t* query_start, const int32_t* q_lens,
           const int32_t* kv_lens, const int32_t* page_tables, float* out)
      : sh_(sh), opt_(opt), q_(q), k_(k), v_(v), k_pages_(k_pages), v_pages_(v_pages),
        query_start_(query_start), q_lens_(q_lens), kv_lens_(kv_lens), page_tables_(page_tables), out_(out) {
    if (sh.page_size > 0 && (sh.page_size & (sh.page_size - 1)) == 0) page_shift_ = __builtin_ctzll(sh.page_size);
    // A sequence of few queries attends its keys in spans (kSpanKeys), from its lowest key's span on.
    spans_.assign(sh.seqs, 1);
    first_span_.assign(sh.seqs, 0);
    int64_t blocks = 0, most_queries = 0, span_items = 0;
    for (int64_t s = 0; s < sh.seqs; ++s) {
      blocks += QueryBlocks(s);
      most_queries = std::max<int64_t>(most_queries, q_lens_[s]);
      if (q_lens_[s] >= 1 && q_lens_[s] <= opt.direct_queries) {
        first_span_[s] = LowestKey({s, 0, 0, 0, 0}) / kSpanKeys;
        spans_[s] = (kv_lens_[s] - 1) / kSpanKeys - first_span_[s] + 1;
      }
      span_items += q_lens_[s] >= 1 ? spans_[s] : 0;
    }
    // An item reads every KV head of its keys (whole token rows of the pages); with few query blocks (a lone
    // decode row) the heads are split over items instead, so that every thread has work, unless its keys come in
    // several spans (below).
    head_splits_ = blocks >= kMinItems ? 1 : sh.kv_heads;
    // A lone sequence verifying draft tokens (a few queries) would give one item per head, as many as a lone
    // decode row (3 heads on 2 threads: one thread idle a third of the time); its queries go in two halves
    // instead, each item reading its head's keys for its half. Not where the keys come in spans enough to give
    // every thread two or more: halves would read every span twice (and run twice the tile passes over it) for no
    // better balance.
    const int64_t threads = HelperPool::Get().num_helpers() + 1;
    if (blocks < kMinItems && most_queries > 1 && most_queries <= opt.direct_queries && span_items < 2 * threads) {
      block_queries_ = (most_queries + 1) / 2;
    }
    item_start_.resize(sh.seqs + 1, 0);
    group_start_.resize(sh.seqs + 1, 0);
    splits_.assign(sh.seqs, head_splits_);
    for (int64_t s = 0; s < sh.seqs; ++s) {
      // spans share the work out instead of heads: an item then reads whole token rows of the pages in order
      if (spans_[s] > 1) splits_[s] = 1;
      const int64_t groups = QueryBlocks(s) * splits_[s];  // items of s but for spans
      item_start_[s + 1] = item_start_[s] + groups * spans_[s];
      group_start_[s + 1] = group_start_[s] + (spans_[s] > 1 ? groups : 0);
    }
    // partial sums of each spanned item: [heads, rows] running max, [heads, rows] sum, [heads, rows, hd] weighted
    // values; a decode row's spans hold up to direct_queries queries
    const int64_t queries = std::min<int64_t>(block_queries_, opt.direct_queries);
    partial_floats_ = sh.kv_heads * queries * sh.group * (sh.head_dim + 2);
    if (group_start_.back() > 0) {
      thread_local std::vector<float> storage;  // reused by the calling thread's next calls
      const auto size = static_cast<size_t>(num_items() * partial_floats_);
      if (storage.size() < size) storage.resize(size);
      partials_ = storage.data();
    }
  }

  int64_t num_items() const { return item_start_.back(); }
  // Groups of spanned items (sequence, block of queries, KV heads) whose partial sums MergeSpans combines.
  int64_t num_span_groups() const { return group_start_.back(); }

 protected:
  static constexpr int64_t kMinItems = 8;
  enum class Into { kL1, kL2 };  // the cache level PrefetchRow asks for lines into

  AttentionItem Locate(int64_t item) const {
    const int64_t s = std::upper_bound(item_start_.begin(), item_start_.end(), item) - item_start_.begin() - 1;
    const int64_t span = (item - item_start_[s]) % spans_[s], local = (item - item_start_[s]) / spans_[s];
    const int64_t first = (local / splits_[s]) * block_queries_, heads = (sh_.kv_heads + splits_[s] - 1) / splits_[s];
    const int64_t h0 = (local % splits_[s]) * heads;
    AttentionItem place{s, h0, std::min<int64_t>(sh_.kv_heads, h0 + heads), first,
                        std::min<int64_t>(block_queries_, q_lens_[s] - first)};
    if (spans_[s] > 1) {
      place.key_lo = (first_span_[s] + span) * kSpanKeys;
      place.key_hi = place.key_lo + kSpanKeys;
      place.partial = item;
    }
    return place;
  }

  // The first key position item `place` attends (its sliding window's start; or its span's).
  int64_t LowestKey(const AttentionItem& place) const {
    const int64_t first_pos = kv_lens_[place.s] - q_lens_[place.s] + place.first;
    const int64_t window = opt_.sliding_window > 0 ? std::max<int64_t>(0, first_pos - opt_.sliding_window + 1) : 0;
    return std::max(window, place.key_lo);
  }

  // The direct path's prefetching: asks for the paged key and value rows of item `place` (whose keys end at `end`),
  // into L2, up to position `until`, at most `budget` positions in this call (a steady trickle: bursts stall on the
  // memory system's queue). Past `end`, the distance goes on into the first keys of item `next`; the cursor (the
  // thread's) remembers where it is, so `next` starts with its first keys already asked for.
  void PrefetchUntil(PrefetchCursor& cursor, const AttentionItem& place, int64_t end, const AttentionItem& next,
                     int64_t until, int64_t budget) const {
    const auto at = [&cursor](const AttentionItem& item) { return cursor.In(item); };
    int64_t pos = cursor.pos;  // a local: the thread_local cursor's fields would be re-addressed every row
    if (at(place)) {
      const int64_t cached = kv_lens_[place.s] - q_lens_[place.s], stop = std::min({until, end, cached});
      for (; pos < stop && budget > 0; ++pos, --budget) {
        PrefetchRow<Into::kL2>(place.s, place.h0, place.h1, pos, cached);
      }
      if (until <= end || next.s < 0 || pos < std::min(end, cached)) {
        cursor.pos = pos;
        return;
      }
      cursor = {next.s, next.h0, next.first, next.key_lo, LowestKey(next)};
      pos = cursor.pos;
    }
    if (next.s >= 0 && at(next)) {
      const int64_t cached = kv_lens_[next.s] - q_lens_[next.s];
      const int64_t stop = std::min(LowestKey(next) + until - end, cached);
      for (; pos < stop && budget > 0; ++pos, --budget) PrefetchRow<Into::kL2>(next.s, next.h0, next.h1, pos, cached);
    }
    cursor.pos = pos;
  }

  // Asks for the paged key and value rows of heads [h0, h1) of sequence s at position `pos` (< cached), into L1
  // or L2 only.
  template <Into kLevel>
  void PrefetchRow(int64_t s, int64_t h0, int64_t h1, int64_t pos, int64_t cached) const {
    const int64_t bytes = (h1 - h0) * sh_.head_dim * static_cast<int64_t>(sizeof(PoolT));
    const float* own;
    const char* k = reinterpret_cast<const char*>(Row(k_pages_, k_, s, h0, pos, cached, &own));
    const char* v = reinterpret_cast<const char*>(Row(v_pages_, v_, s, h0, pos, cached, &own));
    for (int64_t line = 0; line < bytes; line += 64) {
      if constexpr (kLevel == Into::kL1) {
        PrefetchLine(k + line);
        PrefetchLine(v + line);
      } else {
        PrefetchLineToL2(k + line);
        PrefetchLineToL2(v + line);
      }
    }
  }

  int64_t QueryBlocks(int64_t s) const {
    return (std::max<int32_t>(q_lens_[s], 0) + block_queries_ - 1) / block_queries_;
  }

  // Key `pos` of sequence s for KV head `head`: from the pages below the cached length, else this step's own.
  template <typename T>
  const T* Row(const T* pages, const float* own, int64_t s, int64_t head, int64_t pos, int64_t cached,
               const float** own_row) const {
    if (pos < cached) {
      // page sizes are powers of two in practice: a shift and a mask instead of a division per key
      const int64_t index = page_shift_ >= 0 ? pos >> page_shift_ : pos / sh_.page_size;
      const int64_t within = page_shift_ >= 0 ? pos & (sh_.page_size - 1) : pos % sh_.page_size;
      const int64_t page = page_tables_[s * sh_.pages_per_seq + index];
      *own_row = nullptr;
      return pages + ((page * sh_.page_size + within) * sh_.kv_heads + head) * sh_.head_dim;
    }
    *own_row = own + ((query_start_[s] + pos - cached) * sh_.kv_heads + head) * sh_.head_dim;
    return nullptr;
  }

  // Asks the memory system for the paged keys and values of heads [h0, h1) at positions [key0, key0 + nkeys).
  void Prefetch(int64_t s, int64_t h0, int64_t h1, int64_t cached, int64_t key0, int64_t nkeys) const {
    for (int64_t pos = key0; pos < std::min(key0 + nkeys, cached); ++pos) {
      PrefetchRow<Into::kL1>(s, h0, h1, pos, cached);
    }
  }

  // Pointers to the rows of keys (or values) key0 .. key0 + nkeys - 1 for KV heads [h0, h1): the cached ones in the
  // pages, the rest (from index `paged` on) this step's own.
  struct BlockRows {
    const PoolT* pages[kBlockKeys];
    const float* own[kBlockKeys];
    int64_t paged;
  };

  // Keys of sequence s below this position are read from the pages by the few-query loops: all of them where the
  // step's own K/V are in the pages, unless its first own token's page is the reserved page 0, where padding goes (a
  // run that stores nothing, such as a logits probe, lists only page 0): then the cached ones.
  int64_t PagedBelow(int64_t s, int64_t cached) const {
    if (!opt_.own_in_pages || kv_lens_[s] <= cached) return cached;
    const int64_t index = page_shift_ >= 0 ? cached >> page_shift_ : cached / sh_.page_size;
    return page_tables_[s * sh_.pages_per_seq + index] != 0 ? kv_lens_[s] : cached;
  }

  // Fills `rows` with pointers into the pages (the prefetch cursor has asked for them ahead) and into this step's own.
  void PointRows(const PoolT* pages, const float* own, int64_t s, int64_t h0, int64_t cached, int64_t key0,
                 int64_t nkeys, BlockRows* rows) const {
    rows->paged = std::clamp<int64_t>(cached - key0, 0, nkeys);
    for (int64_t j = 0; j < nkeys; ++j) rows->pages[j] = Row(pages, own, s, h0, key0 + j, cached, &rows->own[j]);
  }

  AttentionShapes sh_;
  AttentionOptions opt_;
  const float *q_, *k_, *v_;
  const PoolT *k_pages_, *v_pages_;
  const int32_t *query_start_, *q_lens_, *kv_lens_, *page_tables_;
  float* out_;
  int64_t head_splits_ = 1;  // items a sequence's KV heads are shared over (but see splits_)
  int64_t block_queries_ = kBlockQueries;  // queries per work item
  int64_t page_shift_ = -1;  // log2(page_size) when it is a power of two
  std::vector<int64_t> item_start_;   // [seqs + 1] first work item of each sequence
  std::vector<int64_t> group_start_;  // [seqs + 1] first span group of each sequence (none where it has 1 span)
  std::vector<int64_t> spans_, first_span_;  // [seqs] spans of keys per sequence, the index of its first
  std::vector<int64_t> splits_;  // [seqs] items its KV heads are shared over (1 where it has several spans)
  int64_t partial_floats_ = 0;  // floats of partial sums per item
  float* partials_ = nullptr;   // [items, partial_floats_] where some sequence has several spans
};

}  // namespace jvllm
