// Ragged paged attention for XLA CPU, as an XLA FFI custom call (jvllm's `cpu` attention backend).
//
// One call serves prefill chunks and decode rows alike: sequence s owns the flat tokens
// query_start[s] .. + q_lens[s] of this step, whose positions continue its cached context
// (kv_lens[s] - q_lens[s] tokens, read from the KV pages). Keys past the cache are this step's own
// k/v, read from its arguments (`jvllm_paged_attention_write` also stores them in the pages first, so the
// pages it returns hold the step's K/V). Work items are (sequence, KV head, block of queries, span of keys:
// page_view.h), attended by attention_work.h, whose spans are then merged; the caller and the kernels' helper
// threads (run_items.h) take items until none are left.
//
// Pages are token-major [num_pages, page_size, kv_heads, head_dim], float32, bfloat16 (stored as its uint16 bits)
// or float8 e5m2 (widened in registers: fp8_rows.h, fp8_attention.h). q, k, v and the output are float32.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "xla/ffi/api/ffi.h"
#include "attention_work.h"
#include "run_items.h"

namespace ffi = xla::ffi;

namespace {

using namespace jvllm;

constexpr int64_t kInlineSpanMerges = 8;  // span groups merged by the calling thread alone, at most

// The merges of a call's spanned items: on this thread where they are few (a lone sequence's), else shared by the
// helper threads too.
template <typename Work>
void MergeAllSpans(const Work& work) {
  const int64_t groups = work.num_span_groups();
  if (groups <= kInlineSpanMerges) {
    for (int64_t group = 0; group < groups; ++group) work.MergeSpans(group);
  } else {
    jvllm::RunItems(SpanMerges<Work>{work});
  }
}

// The attention of a call over pages of PoolT, by its work items, then its spans merged.
template <typename PoolT>
void AttendOver(const AttentionShapes& sh, const AttentionOptions& opt, const float* q, const float* k,
                const float* v, const void* k_pages, const void* v_pages, const int32_t* query_start,
                const int32_t* q_lens, const int32_t* kv_lens, const int32_t* page_tables, float* dst) {
  Attention<PoolT> work(sh, opt, q, k, v, static_cast<const PoolT*>(k_pages), static_cast<const PoolT*>(v_pages),
                        query_start, q_lens, kv_lens, page_tables, dst);
  jvllm::RunItems(work);
  MergeAllSpans(work);
}

// Attention over pages at k_pages / v_pages (float32, bfloat16 bits or e5m2, by `type`) into out.
ffi::Error Attend(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                  ffi::Span<const int64_t> pd, ffi::DataType type, const void* k_pages, const void* v_pages,
                  ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                  ffi::Buffer<ffi::S32> page_tables, float* dst, float scale, int64_t sliding_window,
                  float soft_cap, int64_t bf16_tiles, bool own_in_pages, int64_t direct_queries) {
  const auto qd = q.dimensions();
  const auto td = page_tables.dimensions();
  if (qd.size() != 3 || pd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention: q [T,H,hd], pages [N,page,KVH,hd], tables [S,P]");
  }
  AttentionShapes sh{qd[0], qd[1], pd[2], qd[2], qd[1] / pd[2], pd[1], td[1], td[0]};
  if (sh.heads % sh.kv_heads != 0 || pd[3] != sh.head_dim || sh.head_dim % kLanes != 0) {
    return ffi::Error::InvalidArgument(
        "paged_attention: heads a multiple of KV heads, one head_dim (a multiple of 16) for q and pages");
  }
  AttentionOptions opt{scale, sliding_window, soft_cap, bf16_tiles != 0, own_in_pages,
                       std::clamp<int64_t>(direct_queries, kDirectQueries, kBlockQueries)};
  // Tokens past the last sequence's are padding: their rows are zero.
  int64_t used = 0;
  for (int64_t s = 0; s < sh.seqs; ++s) {
    used = std::max<int64_t>(used, query_start.typed_data()[s] + q_lens.typed_data()[s]);
  }
  used = std::min(used, sh.tokens);
  std::fill(dst + used * sh.heads * sh.head_dim, dst + sh.tokens * sh.heads * sh.head_dim, 0.0f);

  const auto args = std::make_tuple(sh, opt, q.typed_data(), k.typed_data(), v.typed_data(), k_pages, v_pages,
                                    query_start.typed_data(), q_lens.typed_data(), kv_lens.typed_data(),
                                    page_tables.typed_data(), dst);
  if (type == ffi::DataType::F32) {
    std::apply(AttendOver<float>, args);
  } else if (type == ffi::DataType::U16 || type == ffi::DataType::BF16) {
    std::apply(AttendOver<uint16_t>, args);
  } else if (type == ffi::DataType::F8E5M2) {
    std::apply(AttendOver<E5m2>, args);
  } else {
    return ffi::Error::InvalidArgument("paged_attention: pages must be float32, bfloat16 (bits) or float8_e5m2");
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> q_lens,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_tables,
                              ffi::ResultBuffer<ffi::F32> out, float scale, int64_t sliding_window,
                              float soft_cap, int64_t bf16_tiles, int64_t direct_queries) {
  return Attend(q, k, v, k_pages.dimensions(), k_pages.element_type(), k_pages.untyped_data(),
                v_pages.untyped_data(), query_start, q_lens, kv_lens, page_tables, out->typed_data(), scale,
                sliding_window, soft_cap, bf16_tiles, false, direct_queries);
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

// rows [T, width] float32 -> the bfloat16 pool's slots (uint16 bits), rounded to nearest even as jnp's astype
// rounds (NaN stays a quiet NaN).
void WriteRowsAsBf16(const float* rows, int64_t tokens, int64_t width, const int32_t* slots,
                     ffi::Result<ffi::AnyBuffer>& pool) {
  const int64_t pool_rows = pool->size_bytes() / std::max<int64_t>(width * 2, 1);
  auto* dst = static_cast<uint16_t*>(pool->untyped_data());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0 || slots[t] >= pool_rows) continue;
    const float* src = rows + t * width;
    uint16_t* out = dst + slots[t] * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      uint32_t u;
      std::memcpy(&u, src + i, sizeof(u));
      const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
      out[i] = static_cast<uint16_t>(nan ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
}

// The step's K/V written into the (aliased) pages at their slots, then the attention over them: the layer's own
// pages are its result, so no pool write runs after the step. K/V to store come in the pages' dtype, or as float32
// for bfloat16 pages (uint16 bits), rounded here as they are written.
ffi::Error PagedAttentionWriteImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                   ffi::AnyBuffer k_store, ffi::AnyBuffer v_store, ffi::AnyBuffer k_pages,
                                   ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> query_start,
                                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> slot_mapping,
                                   ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                                   ffi::Result<ffi::AnyBuffer> v_out, float scale, int64_t sliding_window,
                                   float soft_cap, int64_t bf16_tiles, int64_t direct_queries) {
  const auto pd = k_pages.dimensions();
  const bool rounds = k_pages.element_type() == ffi::DataType::U16 && v_pages.element_type() == ffi::DataType::U16 &&
                      k_store.element_type() == ffi::DataType::F32 && v_store.element_type() == ffi::DataType::F32;
  const int64_t store_bytes = rounds ? 4 : static_cast<int64_t>(ffi::ByteWidth(k_pages.element_type()));
  if ((!rounds && (k_store.element_type() != k_pages.element_type() ||
                   v_store.element_type() != v_pages.element_type())) ||
      k_store.dimensions().size() != 3 || pd.size() != 4 ||
      k_store.size_bytes() != k.dimensions()[0] * pd[2] * pd[3] * store_bytes ||
      v_store.size_bytes() != k_store.size_bytes() || slot_mapping.dimensions()[0] != k.dimensions()[0]) {
    return ffi::Error::InvalidArgument(
        "paged_attention_write: k/v to store [T, KVH, hd] in the pages' dtype (or float32 for bfloat16 pages)");
  }
  if (k_out->untyped_data() != k_pages.untyped_data()) {  // not aliased: start from the pages given
    std::memcpy(k_out->untyped_data(), k_pages.untyped_data(), k_pages.size_bytes());
    std::memcpy(v_out->untyped_data(), v_pages.untyped_data(), v_pages.size_bytes());
  }
  if (rounds) {
    const int64_t tokens = k.dimensions()[0], width = pd[2] * pd[3];
    WriteRowsAsBf16(static_cast<const float*>(k_store.untyped_data()), tokens, width, slot_mapping.typed_data(), k_out);
    WriteRowsAsBf16(static_cast<const float*>(v_store.untyped_data()), tokens, width, slot_mapping.typed_data(), v_out);
  } else {
    WriteRows(k_store, slot_mapping.typed_data(), k_out);
    WriteRows(v_store, slot_mapping.typed_data(), v_out);
  }
  return Attend(q, k, v, pd, k_pages.element_type(), k_out->untyped_data(), v_out->untyped_data(), query_start,
                q_lens, kv_lens, page_tables, out->typed_data(), scale, sliding_window, soft_cap, bf16_tiles, true,
                direct_queries);
}

}  // namespace

// Whether this build attends prefill blocks over bfloat16 pages in bf16 tiles (bf16_prefill_attention.h).
extern "C" int32_t JvllmBf16PrefillTiles() { return jvllm::kBf16Prefill ? 1 : 0; }

// dst[i] = the bfloat16 bits of e5m2 byte src[i], i < n: the exact conversion of the prefill tiles' rows (for tests).
extern "C" void JvllmE5m2ToBf16(const uint8_t* src, int64_t n, uint16_t* dst) {
  jvllm::E5m2ToBf16(reinterpret_cast<const jvllm::E5m2*>(src), n, dst);
}

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
                                  .Attr<int64_t>("bf16_tiles")
                                  .Attr<int64_t>("direct_queries"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmPagedAttentionWrite, PagedAttentionWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, KVH, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, KVH, hd]
                                  .Arg<ffi::AnyBuffer>()         // k to store [T, KVH, hd]: the pages' dtype or f32
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
                                  .Attr<int64_t>("bf16_tiles")
                                  .Attr<int64_t>("direct_queries"));

