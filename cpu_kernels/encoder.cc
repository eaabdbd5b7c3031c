// An encoder layer's attention over packed rows, as an XLA FFI custom call for XLA CPU. Encoder batches pack several
// short sequences into each row (jvllm.pooling.batching); XLA computes the attention over the whole row width with
// a mask ([R, H, W, W] scores, most of them masked) and the heads' transposes. Here each sequence's queries meet only
// its own keys, read straight from the q/k/v product.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_vectors.h"
#include "run_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jvllm::kLanes;
using jvllm::LoadV;
using jvllm::VecExp;
using jvllm::VF;

namespace {

inline VF MaxV(VF a, VF b) { return a > b ? a : b; }

// Bidirectional attention within segments: qkv [R, W, 3 H hd] (per token: the queries of every head, then the keys,
// then the values, without their biases), segments [R, W] (0: padding, else the token's sequence; a token sees the
// tokens of its row with its own value), bias [3 H hd] -> out [R, W, H hd], zero for padding. Per head:
// s_j = ((q + bq) . k_j) * scale, p_j = exp(s_j - max s), out = (sum_j p_j v_j) / sum_j p_j + bv. That is the
// attention of the biased q, k and v: the key bias adds (q + bq) . bk to every score of a query, which the softmax
// cancels, and since the p_j / sum p sum to 1 the value bias comes out as bv.
//
// The queries of a sequence go kLanes at a time, one a lane: their scores against each key, the softmax over the
// keys and the weighted sums of the values are then whole-vector steps (the keys' and values' elements broadcast
// from memory), with no per-query reductions across lanes. One item a row and group of heads.
struct SegmentAttention {
  const float* qkv;
  const int32_t* segments;
  const float* bias;
  float* out;
  int64_t rows, width, heads, head_dim, heads_per_item;
  float scale;

  static constexpr int kKeys = 4;  // keys a pass over the queries' dimensions: independent chains of products

  int64_t groups() const { return (heads + heads_per_item - 1) / heads_per_item; }
  int64_t num_items() const { return rows * groups(); }

  void Run(int64_t item) const {
    const int64_t r = item / groups(), h0 = item % groups() * heads_per_item;
    const int64_t h1 = std::min(heads, h0 + heads_per_item), dim = heads * head_dim;
    const int32_t* seg = segments + r * width;
    thread_local std::vector<int64_t> order;  // the row's real tokens by sequence, then position
    order.clear();
    for (int64_t i = 0; i < width; ++i) {
      if (seg[i] != 0) {
        order.push_back(i);
      } else {
        for (int64_t h = h0; h < h1; ++h) std::fill_n(out + (r * width + i) * dim + h * head_dim, head_dim, 0.0f);
      }
    }
    std::stable_sort(order.begin(), order.end(), [seg](int64_t a, int64_t b) { return seg[a] < seg[b]; });
    const int64_t columns = static_cast<int64_t>(order.size());
    for (int64_t first = 0; first < columns;) {
      int64_t last = first + 1;
      while (last < columns && seg[order[last]] == seg[order[first]]) ++last;
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t i = first; i < last; i += kLanes) {
          Queries(r, h, order.data() + i, std::min<int64_t>(kLanes, last - i), order.data() + first, last - first);
        }
      }
      first = last;
    }
  }

  // Up to kLanes queries (tokens[0 .. count)) of head h against the n tokens of their sequence (keys[0 .. n)).
  void Queries(int64_t r, int64_t h, const int64_t* tokens, int64_t count, const int64_t* keys, int64_t n) const {
    const int64_t stride = 3 * heads * head_dim;  // floats from one token's q/k/v to the next's
    const float* row = qkv + r * width * stride;
    thread_local std::vector<VF> query_lanes;  // [hd] the queries' elements (with bq), a lane a query
    thread_local std::vector<VF> scores;       // [n] each key's scores, a lane a query; then exp(s - max)
    query_lanes.resize(static_cast<size_t>(head_dim));
    scores.resize(static_cast<size_t>(n));
    GatherQueries(row + h * head_dim, stride, tokens, count, bias + h * head_dim, query_lanes.data());
    const float* k_base = row + heads * head_dim + h * head_dim;
    int64_t j = 0;
    for (; j + kKeys <= n; j += kKeys) KeyScores<kKeys>(query_lanes.data(), k_base, stride, keys + j, &scores[j]);
    for (; j < n; ++j) KeyScores<1>(query_lanes.data(), k_base, stride, keys + j, &scores[j]);
    VF top = scores[0];
    for (j = 1; j < n; ++j) top = MaxV(top, scores[j]);
    VF total{};
    for (j = 0; j < n; ++j) {
      scores[j] = VecExp(scores[j] - top);
      total += scores[j];
    }
    // Each query's weighted sum of the values, the values' rows as vectors and the query's weights broadcast.
    const float* v_base = row + 2 * heads * head_dim + h * head_dim;
    const float* weights = reinterpret_cast<const float*>(scores.data());  // [n, kLanes]
    const float* bv = bias + 2 * heads * head_dim + h * head_dim;
    const int64_t vectors = head_dim / kLanes;
    if (head_dim % kLanes == 0 && (vectors == 1 || vectors == 2 || vectors == 4 || vectors == 8)) {
      const Outputs at{out + r * width * heads * head_dim + h * head_dim, heads * head_dim, tokens, v_base, stride,
                       keys, n, weights, &total, bv};
      switch (vectors) {
        case 1: return at.Run<1, 4>(count);
        case 2: return at.Run<2, 4>(count);
        case 4: return at.Run<4, 2>(count);
        default: return at.Run<8, 1>(count);
      }
    }
    for (int64_t a = 0; a < count; ++a) {
      float* o = out + (r * width + tokens[a]) * heads * head_dim + h * head_dim;
      const float inverse_total = 1.0f / total[a];
      std::fill_n(o, head_dim, 0.0f);
      for (j = 0; j < n; ++j) {
        const float pj = weights[j * kLanes + a];
        const float* v = v_base + keys[j] * stride;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] += pj * v[d];
      }
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] = o[d] * inverse_total + bv[d];
    }
  }

  // The queries' outputs for head sizes of whole vectors: each query's weighted sum of the value rows (its weights
  // broadcast), Q queries at a time so that their sums make independent chains.
  struct Outputs {
    float* out;  // the row's first token's output of the head; tokens `dim` floats apart
    int64_t dim;
    const int64_t* tokens;
    const float* v_base;
    int64_t stride;
    const int64_t* keys;
    int64_t n;
    const float* weights;  // [n, kLanes]: exp(s - max), a lane a query
    const VF* total;
    const float* bv;

    template <int V, int Q>
    void Run(int64_t count) const {
      int64_t a = 0;
      for (; a + Q <= count; a += Q) Queries<V, Q>(a);
      for (; a < count; ++a) Queries<V, 1>(a);
    }

    template <int V, int Q>
    void Queries(int64_t a0) const {
      VF acc[Q][V] = {};
      for (int64_t j = 0; j < n; ++j) {
        const float* v = v_base + keys[j] * stride;
        VF rows[V];
        for (int c = 0; c < V; ++c) rows[c] = LoadV(v + c * kLanes);
        for (int b = 0; b < Q; ++b) {
          const float pj = weights[j * kLanes + a0 + b];
          for (int c = 0; c < V; ++c) acc[b][c] += pj * rows[c];
        }
      }
      for (int b = 0; b < Q; ++b) {
        const float inverse_total = 1.0f / (*total)[a0 + b];
        float* o = out + tokens[a0 + b] * dim;
        for (int c = 0; c < V; ++c) {
          *reinterpret_cast<jvllm::VFUnaligned*>(o + c * kLanes) = acc[b][c] * inverse_total + LoadV(bv + c * kLanes);
        }
      }
    }
  };

  // q[d] (lane a) = row_q[tokens[a] * stride + d] + bq[d] for a < count, 0 in the other lanes.
  void GatherQueries(const float* row_q, int64_t stride, const int64_t* tokens, int64_t count, const float* bq,
                     VF* q) const {
#if defined(__AVX512F__)
    alignas(64) int32_t offsets[16] = {};
    for (int64_t a = 0; a < count; ++a) offsets[a] = static_cast<int32_t>(tokens[a] * stride);
    const __m512i index = _mm512_load_si512(offsets);
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1u);
    for (int64_t d = 0; d < head_dim; ++d) {
      const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, index, row_q + d, 4);
      q[d] = reinterpret_cast<const VF&>(v) + bq[d];
    }
#else
    float* lanes = reinterpret_cast<float*>(q);
    for (int64_t a = 0; a < count; ++a) {
      const float* source = row_q + tokens[a] * stride;
      for (int64_t d = 0; d < head_dim; ++d) lanes[d * kLanes + a] = source[d] + bq[d];
    }
#endif
  }

  // The scores of K keys (tokens keys[0 .. K)) for the queries in q ([hd] a lane a query) -> out[0 .. K).
  template <int K>
  void KeyScores(const VF* q, const float* k_base, int64_t stride, const int64_t* keys, VF* out) const {
    const float* k[K];
    for (int b = 0; b < K; ++b) k[b] = k_base + keys[b] * stride;
    VF acc[K] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      for (int b = 0; b < K; ++b) acc[b] += k[b][d] * q[d];
    }
    for (int b = 0; b < K; ++b) out[b] = acc[b] * scale;
  }
};

ffi::Error SegmentAttentionImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::F32> bias,
                                ffi::ResultBuffer<ffi::F32> out, int64_t num_heads) {
  const auto qd = qkv.dimensions(), sd = segments.dimensions();
  if (qd.size() != 3 || sd.size() != 2 || sd[0] != qd[0] || sd[1] != qd[1] || num_heads < 1 ||
      qd[2] % (3 * num_heads) != 0 || bias.element_count() != static_cast<size_t>(qd[2])) {
    return ffi::Error::InvalidArgument("segment_attention: qkv [R, W, 3 H hd], segments [R, W], bias [3 H hd]");
  }
  const int64_t head_dim = qd[2] / (3 * num_heads), rows = qd[0];
  // Whole rows where there are enough of them to share among the threads (twice over), else heads split among items.
  const int64_t threads = jvllm::HelperPool::Get().num_helpers() + 1;
  const int64_t groups = std::clamp<int64_t>((2 * threads + rows - 1) / std::max<int64_t>(rows, 1), 1, num_heads);
  jvllm::RunItems(SegmentAttention{qkv.typed_data(), segments.typed_data(), bias.typed_data(), out->typed_data(), rows,
                                   qd[1], num_heads, head_dim, (num_heads + groups - 1) / groups,
                                   1.0f / std::sqrt(static_cast<float>(head_dim))});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmSegmentAttention, SegmentAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [R, W, 3 H hd], no biases
                                  .Arg<ffi::Buffer<ffi::S32>>()  // segments [R, W]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [3 H hd]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [R, W, H hd]
                                  .Attr<int64_t>("num_heads"));
