// Ragged paged attention for XLA CPU, as an XLA FFI custom call (jvllm's `cpu` attention backend).
//
// One call serves prefill chunks and decode rows alike: sequence s owns the flat tokens
// query_start[s] .. + q_lens[s] of this step, whose positions continue its cached context
// (kv_lens[s] - q_lens[s] tokens, read from the KV pages). Keys past the cache are this step's own
// k/v, read from its arguments (`jvllm_paged_attention_write` also stores them in the pages first, so the
// pages it returns hold the step's K/V). Work items are (sequence, KV head, block of queries); the
// caller and the kernels' helper threads (run_items.h) take items until none are left.
//
// Pages are token-major [num_pages, page_size, kv_heads, head_dim], float32 or bfloat16 (stored as
// its uint16 bits). q, k, v and the output are float32.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "attention_vectors.h"
#include "bf16_attention.h"
#include "bf16_prefill_attention.h"
#include "few_row_attention.h"
#include "run_items.h"
#include "transpose.h"

namespace ffi = xla::ffi;

namespace {

using namespace jvllm;

constexpr int kBlockKeys = 64;     // keys per score block
constexpr int kBlockQueries = 32;  // queries per work item: each block of keys is transposed once for them all
constexpr int kDirectRows = 4;     // up to this many score rows, key rows are multiplied as stored (no transpose)
constexpr int kDirectQueries = 8;  // ... and for up to this many queries (a decode row verifying draft tokens)
constexpr int kStripKeys = 16;     // direct path: keys of every head per strip, so token rows are read in order
constexpr int kPrefetchKeys = 64;  // direct path: how far ahead of the work (in key positions) rows are asked for
constexpr float kMasked = -1e30f;  // finite: exp() of it underflows to 0 without NaNs

struct Shapes {
  int64_t tokens, heads, kv_heads, head_dim, group, page_size, pages_per_seq, seqs;
};

struct Options {
  float scale;
  int64_t sliding_window;  // 0: none
  float soft_cap;          // 0: none
  bool bf16_tiles;         // prefill blocks over bf16 pages may round queries and probabilities to bf16
  // The step's own K/V are in the pages already (the write variant): the few-query loops read them there, so a query
  // sees every key as the pages hold it, whether its step ran it alone or with draft tokens after it.
  bool own_in_pages;
};

// Per-thread scratch space, sized on first use.
struct Scratch {
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
  // the direct path's prefetch cursor: the next key position whose paged rows are asked for, in work item
  // (sequence s, heads from h0, queries from first): the item being attended, or the one its thread runs next
  struct Cursor {
    int64_t s = -1, h0 = 0, first = 0, pos = 0;
  } cursor;

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

template <typename PoolT>
class Attention {
 public:
  Attention(const Shapes& sh, const Options& opt, const float* q, const float* k, const float* v,
            const PoolT* k_pages, const PoolT* v_pages, const int32_t* query_start, const int32_t* q_lens,
            const int32_t* kv_lens, const int32_t* page_tables, float* out)
      : sh_(sh), opt_(opt), q_(q), k_(k), v_(v), k_pages_(k_pages), v_pages_(v_pages),
        query_start_(query_start), q_lens_(q_lens), kv_lens_(kv_lens), page_tables_(page_tables), out_(out) {
    if (sh.page_size > 0 && (sh.page_size & (sh.page_size - 1)) == 0) page_shift_ = __builtin_ctzll(sh.page_size);
    int64_t blocks = 0, most_queries = 0;
    for (int64_t s = 0; s < sh.seqs; ++s) {
      blocks += QueryBlocks(s);
      most_queries = std::max<int64_t>(most_queries, q_lens_[s]);
    }
    // An item reads every KV head of its keys (whole token rows of the pages); with few query blocks (a lone
    // decode row) the heads are split over items instead, so that every thread has work.
    head_splits_ = blocks >= kMinItems ? 1 : sh.kv_heads;
    // A lone sequence verifying draft tokens (a few queries) would give one item per head, as many as a lone
    // decode row (3 heads on 2 threads: one thread idle a third of the time); its queries go in two halves
    // instead, each item reading its head's keys for its half.
    if (blocks < kMinItems && most_queries > 1 && most_queries <= kDirectQueries) {
      block_queries_ = (most_queries + 1) / 2;
    }
    heads_per_item_ = (sh.kv_heads + head_splits_ - 1) / head_splits_;
    item_start_.resize(sh.seqs + 1, 0);
    for (int64_t s = 0; s < sh.seqs; ++s) item_start_[s + 1] = item_start_[s] + QueryBlocks(s) * head_splits_;
  }

  int64_t num_items() const { return item_start_.back(); }

  // Runs work item `item`; decode rows also ask for the first paged keys and values of item `next` (the next this
  // thread runs, -1: none) as they near their end.
  void RunWithNext(int64_t item, int64_t next) const {
    Attend(Locate(item), next >= 0 ? Locate(next) : Place{});
  }

 private:
  static constexpr int64_t kMinItems = 8;

  // What a work item attends: queries [first, first + count) of sequence s, KV heads [h0, h1).
  struct Place {
    int64_t s = -1, h0 = 0, h1 = 0, first = 0, count = 0;
  };

  Place Locate(int64_t item) const {
    const int64_t s = std::upper_bound(item_start_.begin(), item_start_.end(), item) - item_start_.begin() - 1;
    const int64_t local = item - item_start_[s];
    const int64_t first = (local / head_splits_) * block_queries_;
    const int64_t h0 = (local % head_splits_) * heads_per_item_;
    return {s, h0, std::min<int64_t>(sh_.kv_heads, h0 + heads_per_item_), first,
            std::min<int64_t>(block_queries_, q_lens_[s] - first)};
  }

  // The first key position item `place` attends (its sliding window's start).
  int64_t LowestKey(const Place& place) const {
    const int64_t first_pos = kv_lens_[place.s] - q_lens_[place.s] + place.first;
    return opt_.sliding_window > 0 ? std::max<int64_t>(0, first_pos - opt_.sliding_window + 1) : 0;
  }

  // The direct path's prefetching: asks for the paged key and value rows of item `place` (whose keys end at `end`)
  // up to position `until`, at most `budget` positions in this call (a steady trickle: bursts stall on the memory
  // system's queue). Past `end`, the distance goes on into the first keys of item `next`; the cursor in scratch
  // remembers where it is, so `next` starts with its first keys already asked for.
  void PrefetchUntil(Scratch& scratch, const Place& place, int64_t end, const Place& next, int64_t until,
                     int64_t budget) const {
    Scratch::Cursor& cursor = scratch.cursor;
    const auto at = [&cursor](const Place& p) { return CursorIn(cursor, p); };
    int64_t pos = cursor.pos;  // a local: the thread_local cursor's fields would be re-addressed every row
    if (at(place)) {
      const int64_t cached = kv_lens_[place.s] - q_lens_[place.s], stop = std::min({until, end, cached});
      for (; pos < stop && budget > 0; ++pos, --budget) PrefetchRow(place.s, place.h0, place.h1, pos, cached);
      if (until <= end || next.s < 0 || pos < std::min(end, cached)) {
        cursor.pos = pos;
        return;
      }
      cursor = {next.s, next.h0, next.first, LowestKey(next)};
      pos = cursor.pos;
    }
    if (next.s >= 0 && at(next)) {
      const int64_t cached = kv_lens_[next.s] - q_lens_[next.s];
      const int64_t stop = std::min(LowestKey(next) + until - end, cached);
      for (; pos < stop && budget > 0; ++pos, --budget) PrefetchRow(next.s, next.h0, next.h1, pos, cached);
    }
    cursor.pos = pos;
  }

  static bool CursorIn(const Scratch::Cursor& cursor, const Place& place) {
    return cursor.s == place.s && cursor.h0 == place.h0 && cursor.first == place.first;
  }

  // Asks for the paged key and value rows of heads [h0, h1) of sequence s at position `pos` (< cached).
  void PrefetchRow(int64_t s, int64_t h0, int64_t h1, int64_t pos, int64_t cached) const {
    const int64_t bytes = (h1 - h0) * sh_.head_dim * static_cast<int64_t>(sizeof(PoolT));
    const float* own;
    const char* k = reinterpret_cast<const char*>(Row(k_pages_, k_, s, h0, pos, cached, &own));
    const char* v = reinterpret_cast<const char*>(Row(v_pages_, v_, s, h0, pos, cached, &own));
    for (int64_t line = 0; line < bytes; line += 64) {
      PrefetchLine(k + line);
      PrefetchLine(v + line);
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
    for (int64_t pos = key0; pos < std::min(key0 + nkeys, cached); ++pos) PrefetchRow(s, h0, h1, pos, cached);
  }

  // Attention of work item `here`; `next` is the item this thread runs after it (s < 0: none).
  void Attend(const Place& here, const Place& next) const {
    thread_local Scratch scratch;
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
    const bool direct = rows <= kDirectRows || count <= kDirectQueries;
    if (direct && !CursorIn(scratch.cursor, here)) {
      scratch.cursor = {s, h0, first, lowest};  // nothing asked for yet: the thread's first item
    }
#if JVLLM_BF16_PREFILL
    if constexpr (std::is_same_v<PoolT, uint16_t>) {
      // bf16 pages on a CPU with bf16 dot products: prefill blocks of queries in transposed tiles
      if (opt_.bf16_tiles && !direct && hd % kBf16Chunk == 0 && opt_.soft_cap == 0.0f) {
        AttendInTiles(scratch, s, h0, h1, count, cached, start, first_pos, lowest);
        return;
      }
    }
#endif
    // bf16 pages on a CPU with bf16 dot products: the direct loops multiply bf16 pairs (bf16_attention.h)
    const bool bf16_dots = std::is_same_v<PoolT, uint16_t> && kBf16Attention && direct && hd % kBf16Chunk == 0;
    if (bf16_dots) {
      SplitToBf16(scratch.queries.data(), heads * rows * hd, scratch.queries_hi.data(), scratch.queries_lo.data());
    }
    if (!direct) Prefetch(s, h0, h1, cached, lowest, kBlockKeys);
    for (int64_t key0 = lowest; key0 <= last_pos; key0 += kBlockKeys) {
      const int64_t nkeys = std::min<int64_t>(kBlockKeys, last_pos + 1 - key0);
      if (direct) {  // few rows (decode): key and value rows read in place, a strip of positions at a time
        // The rows kPrefetchKeys positions ahead of the work (on into the thread's next item) are asked for as it
        // goes, after each head's strip: a loop of loads alone, or loads interleaved with arithmetic, leave the
        // memory system idle much of the time (docs/design.md, "Decode attention: prefetching ahead of the work").
        int64_t before = 0;
        const auto prefetch = [&](int64_t done) {  // done: of the block's two passes over its nkeys keys
          PrefetchUntil(scratch, here, last_pos + 1, next, key0 + done / 2 + kPrefetchKeys, done - before + 1);
          before = done;
        };
        DirectScores(scratch, s, h0, h1, cached, key0, nkeys, rows, scratch.queries.data(), bf16_dots, scores,
                     prefetch);
        for (int64_t h = 0; h < heads; ++h) Mask(first_pos, group, key0, nkeys, rows, scores + h * rows * kBlockKeys);
        Softmax(heads * rows, scores, scratch.row_max.data(), scratch.denom.data(), scratch.rescale.data());
        if (bf16_dots) {
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
        Mask(first_pos, group, key0, nkeys, rows, scores);
        Softmax(rows, scores, scratch.row_max.data() + off, scratch.denom.data() + off, scratch.rescale.data());
        Values(scratch, s, h, cached, key0, nkeys, rows, scores, scratch.rescale.data(), scratch.acc.data() + off * hd);
      }
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
  void AttendInTiles(Scratch& scratch, int64_t s, int64_t h0, int64_t h1, int64_t count, int64_t cached,
                     int64_t start, int64_t first_pos, int64_t lowest) const {
    if constexpr (std::is_same_v<PoolT, uint16_t>) {
      const int64_t hd = sh_.head_dim, group = sh_.group;
      const PrefillQueries block{scratch.queries.data(), h1 - h0, count * group, group, hd, first_pos, lowest,
                                 opt_.sliding_window};
      Prefetch(s, h0, h1, cached, lowest, kBlockKeys);
      AttendPrefillQueries(
          block, kBlockKeys,
          [&](int64_t h, int64_t pos, uint16_t* k_buf, uint16_t* v_buf, const uint16_t** key, const uint16_t** value) {
            const float *own_k, *own_v;
            *key = Row(k_pages_, k_, s, h0 + h, pos, cached, &own_k);
            *value = Row(v_pages_, v_, s, h0 + h, pos, cached, &own_v);
            if (own_k != nullptr) {  // this step's own rows: rounded as the pages store them
              RoundToBf16(own_k, hd, k_buf);
              RoundToBf16(own_v, hd, v_buf);
              *key = k_buf;
              *value = v_buf;
            }
          },
          [&](int64_t key0, int64_t nkeys) { Prefetch(s, h0, h1, cached, key0, nkeys); },
          [&](int64_t h, int64_t r) { return out_ + ((start + r / group) * sh_.heads + (h0 + h) * group + r % group) * hd; });
    }
  }
#endif

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

  // Every head of [h0, h1): scores[h, r, j] = q_{h,r} . key_{key0 + j, h} (scaled, soft-capped), for j < nkeys. Keys
  // are read once for the head's rows (few_row_attention.h); with `bf16_dots`, the paged ones against the queries'
  // two bf16 parts in scratch (bf16_attention.h). prefetch(done) is called after each head's strip, `done` of the
  // block's 2 x nkeys key passes behind it (this pass: the first nkeys).
  template <typename AskAhead>
  void DirectScores(Scratch& scratch, int64_t s, int64_t h0, int64_t h1, int64_t cached, int64_t key0, int64_t nkeys,
                    int64_t rows, const float* queries, bool bf16_dots, float* scores, const AskAhead& prefetch) const {
    const int64_t hd = sh_.head_dim, heads = h1 - h0;
    BlockRows keys;
    PointRows(k_pages_, k_, s, h0, PagedBelow(s, cached), key0, nkeys, &keys);
    for (int64_t j0 = 0; j0 < nkeys; j0 += kStripKeys) {
      const int64_t j1 = std::min<int64_t>(nkeys, j0 + kStripKeys), paged = std::clamp(keys.paged, j0, j1);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = queries + h * rows * hd;
        float* sh = scores + h * rows * kBlockKeys;
        if constexpr (std::is_same_v<PoolT, uint16_t>) {
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
  void DirectValues(Scratch& scratch, int64_t s, int64_t h0, int64_t h1, int64_t cached, int64_t key0, int64_t nkeys,
                    int64_t rows, const float* probs, const uint16_t* probs_hi, const uint16_t* probs_lo,
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
        if constexpr (std::is_same_v<PoolT, uint16_t>) {
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

  static void Rescale(float* acc, const float* rescale, int64_t rows, int64_t hd) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < hd; c += kLanes) StoreV(acc + r * hd + c, LoadV(acc + r * hd + c) * rescale[r]);
  }

  // One head: scores[r, j] = q_r . key_{key0 + j} (scaled, soft-capped), for j < nkeys. The keys are transposed
  // once into [hd, kBlockKeys] (8 x 8 at a time), then 6 rows x 2 vectors of keys per pass.
  void Scores(Scratch& scratch, int64_t s, int64_t head, int64_t cached, int64_t key0, int64_t nkeys,
              int64_t rows, const float* queries, float* scores) const {
    const int64_t hd = sh_.head_dim;
    float* kt = scratch.keys_t.data();
    const float** krows = scratch.value_rows.data();  // the block's key rows as float32 (past nkeys: zeros)
    for (int64_t j = 0; j < kBlockKeys; ++j) {
      const float* own = scratch.zeros.data();
      const PoolT* paged = j < nkeys ? Row(k_pages_, k_, s, head, key0 + j, cached, &own) : nullptr;
      if (paged == nullptr) {
        krows[j] = own;
      } else if constexpr (std::is_same_v<PoolT, float>) {
        krows[j] = paged;
      } else {
        float* dst = scratch.values.data() + j * hd;
        for (int64_t c = 0; c < hd / kLanes; ++c) StoreV(dst + c * kLanes, LoadV(paged + c * kLanes));
        krows[j] = dst;
      }
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

  // N rows of queries [N, hd] times transposed keys [hd, kBlockKeys] -> scores [N, kBlockKeys], two vectors of keys
  // at a time: N x 2 accumulators fit AVX2's 16 registers, where N x a whole block's 8 vectors would not.
  template <int N>
  static void ScoreRows(const float* queries, const float* kt, int64_t hd, float* scores) {
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

  // Causal (and sliding-window) mask: row r is query (first_pos + r / group); keys past nkeys are masked too.
  void Mask(int64_t first_pos, int64_t group, int64_t key0, int64_t nkeys, int64_t rows, float* scores) const {
    const int64_t window = opt_.sliding_window;
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
  void Softmax(int64_t rows, float* scores, float* row_max, float* denom, float* rescale) const {
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

  // One head: acc[r] = acc[r] * rescale[r] + probs[r] @ values of keys [key0, key0 + nkeys).
  void Values(Scratch& scratch, int64_t s, int64_t head, int64_t cached, int64_t key0, int64_t nkeys, int64_t rows,
              const float* probs, const float* rescale, float* acc) const {
    const int64_t hd = sh_.head_dim;
    const float** vrows = scratch.value_rows.data();
    for (int64_t j = 0; j < nkeys; ++j) {
      const float* own;
      const PoolT* paged = Row(v_pages_, v_, s, head, key0 + j, cached, &own);
      if (own != nullptr) {
        vrows[j] = own;
      } else if constexpr (std::is_same_v<PoolT, float>) {
        vrows[j] = paged;
      } else {
        float* dst = scratch.values.data() + j * hd;
        for (int64_t c = 0; c < hd / kLanes; ++c) StoreV(dst + c * kLanes, LoadV(paged + c * kLanes));
        vrows[j] = dst;
      }
    }
    Rescale(acc, rescale, rows, hd);
    FewRowValues(rows, probs, kBlockKeys, vrows, 0, 0, nkeys, acc, hd);
  }

  static float RowMax(const float* scores) {
    VF best = LoadV(scores);
    for (int c = 1; c < kBlockKeys / kLanes; ++c) {
      const VF x = LoadV(scores + c * kLanes);
      best = x > best ? x : best;
    }
    return Max(best);
  }

  Shapes sh_;
  Options opt_;
  const float *q_, *k_, *v_;
  const PoolT *k_pages_, *v_pages_;
  const int32_t *query_start_, *q_lens_, *kv_lens_, *page_tables_;
  float* out_;
  int64_t head_splits_ = 1, heads_per_item_ = 1;
  int64_t block_queries_ = kBlockQueries;  // queries per work item
  int64_t page_shift_ = -1;  // log2(page_size) when it is a power of two
  std::vector<int64_t> item_start_;  // [seqs + 1] first work item of each sequence
};

// Attention over pages at k_pages / v_pages (float32 or bfloat16 bits, by `type`) into out.
ffi::Error Attend(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                  ffi::Span<const int64_t> pd, ffi::DataType type, const void* k_pages, const void* v_pages,
                  ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                  ffi::Buffer<ffi::S32> page_tables, float* dst, float scale, int64_t sliding_window,
                  float soft_cap, int64_t bf16_tiles, bool own_in_pages) {
  const auto qd = q.dimensions();
  const auto td = page_tables.dimensions();
  if (qd.size() != 3 || pd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention: q [T,H,hd], pages [N,page,KVH,hd], tables [S,P]");
  }
  Shapes sh{qd[0], qd[1], pd[2], qd[2], qd[1] / pd[2], pd[1], td[1], td[0]};
  if (sh.heads % sh.kv_heads != 0 || pd[3] != sh.head_dim || sh.head_dim % kLanes != 0) {
    return ffi::Error::InvalidArgument(
        "paged_attention: heads a multiple of KV heads, one head_dim (a multiple of 16) for q and pages");
  }
  Options opt{scale, sliding_window, soft_cap, bf16_tiles != 0, own_in_pages};
  // Tokens past the last sequence's are padding: their rows are zero.
  int64_t used = 0;
  for (int64_t s = 0; s < sh.seqs; ++s) {
    used = std::max<int64_t>(used, query_start.typed_data()[s] + q_lens.typed_data()[s]);
  }
  used = std::min(used, sh.tokens);
  std::fill(dst + used * sh.heads * sh.head_dim, dst + sh.tokens * sh.heads * sh.head_dim, 0.0f);

  if (type == ffi::DataType::F32) {
    Attention<float> work(sh, opt, q.typed_data(), k.typed_data(), v.typed_data(),
                          static_cast<const float*>(k_pages), static_cast<const float*>(v_pages),
                          query_start.typed_data(), q_lens.typed_data(), kv_lens.typed_data(),
                          page_tables.typed_data(), dst);
    jvllm::RunItems(work);
  } else if (type == ffi::DataType::U16 || type == ffi::DataType::BF16) {
    Attention<uint16_t> work(sh, opt, q.typed_data(), k.typed_data(), v.typed_data(),
                             static_cast<const uint16_t*>(k_pages), static_cast<const uint16_t*>(v_pages),
                             query_start.typed_data(), q_lens.typed_data(), kv_lens.typed_data(),
                             page_tables.typed_data(), dst);
    jvllm::RunItems(work);
  } else {
    return ffi::Error::InvalidArgument("paged_attention: pages must be float32 or bfloat16 (bits)");
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> q_lens,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_tables,
                              ffi::ResultBuffer<ffi::F32> out, float scale, int64_t sliding_window,
                              float soft_cap, int64_t bf16_tiles) {
  return Attend(q, k, v, k_pages.dimensions(), k_pages.element_type(), k_pages.untyped_data(),
                v_pages.untyped_data(), query_start, q_lens, kv_lens, page_tables, out->typed_data(), scale,
                sliding_window, soft_cap, bf16_tiles, false);
}

// Copies row t of `rows` [T, row bytes] to pool row slots[t] (pool [N * page, row bytes]); slots outside the pool
// are skipped.
void WriteRows(const ffi::AnyBuffer& rows, const int32_t* slots, ffi::Result<ffi::AnyBuffer>& pool) {
  const int64_t tokens = rows.dimensions()[0];
  const int64_t row_bytes = rows.size_bytes() / std::max<int64_t>(tokens, 1);
  const int64_t pool_rows = pool->size_bytes() / std::max<int64_t>(row_bytes, 1);
  const auto* src = static_cast<const uint8_t*>(rows.untyped_data());
  auto* dst = static_cast<uint8_t*>(pool->untyped_data());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0 && slots[t] < pool_rows) std::memcpy(dst + slots[t] * row_bytes, src + t * row_bytes, row_bytes);
  }
}

// The step's K/V written into the (aliased) pages at their slots, then the attention over them: the layer's own
// pages are its result, so no pool write runs after the step.
ffi::Error PagedAttentionWriteImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                   ffi::AnyBuffer k_store, ffi::AnyBuffer v_store, ffi::AnyBuffer k_pages,
                                   ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> query_start,
                                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> slot_mapping,
                                   ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                                   ffi::Result<ffi::AnyBuffer> v_out, float scale, int64_t sliding_window,
                                   float soft_cap, int64_t bf16_tiles) {
  const auto pd = k_pages.dimensions();
  if (k_store.element_type() != k_pages.element_type() || v_store.element_type() != v_pages.element_type() ||
      k_store.dimensions().size() != 3 || pd.size() != 4 ||
      k_store.size_bytes() != k.dimensions()[0] * pd[2] * pd[3] * static_cast<int64_t>(ffi::ByteWidth(k_pages.element_type())) ||
      v_store.size_bytes() != k_store.size_bytes() || slot_mapping.dimensions()[0] != k.dimensions()[0]) {
    return ffi::Error::InvalidArgument("paged_attention_write: k/v to store [T, KVH, hd] in the pages' dtype");
  }
  if (k_out->untyped_data() != k_pages.untyped_data()) {  // not aliased: start from the pages given
    std::memcpy(k_out->untyped_data(), k_pages.untyped_data(), k_pages.size_bytes());
    std::memcpy(v_out->untyped_data(), v_pages.untyped_data(), v_pages.size_bytes());
  }
  WriteRows(k_store, slot_mapping.typed_data(), k_out);
  WriteRows(v_store, slot_mapping.typed_data(), v_out);
  return Attend(q, k, v, pd, k_pages.element_type(), k_out->untyped_data(), v_out->untyped_data(), query_start,
                q_lens, kv_lens, page_tables, out->typed_data(), scale, sliding_window, soft_cap, bf16_tiles, true);
}

}  // namespace

// Whether this build attends prefill blocks over bfloat16 pages in bf16 tiles (bf16_prefill_attention.h).
extern "C" int32_t JvllmBf16PrefillTiles() { return jvllm::kBf16Prefill ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, KVH, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, KVH, hd]
                                  .Arg<ffi::AnyBuffer>()         // k_pages [N, page, KVH, hd]
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_tables [S, P]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, hd]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("bf16_tiles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmPagedAttentionWrite, PagedAttentionWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, KVH, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, KVH, hd]
                                  .Arg<ffi::AnyBuffer>()         // k to store [T, KVH, hd], the pages' dtype
                                  .Arg<ffi::AnyBuffer>()         // v to store
                                  .Arg<ffi::AnyBuffer>()         // k_pages [N, page, KVH, hd] (aliased: k_out)
                                  .Arg<ffi::AnyBuffer>()         // v_pages (aliased: v_out)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, hd]
                                  .Ret<ffi::AnyBuffer>()         // k_pages with the step's keys
                                  .Ret<ffi::AnyBuffer>()         // v_pages with the step's values
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("bf16_tiles"));

