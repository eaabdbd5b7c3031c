"""The xla backend against the jnp references: the decode page loop, and steps with prefill chunks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention import xla as xla_backend
from models.attention import AttentionMetadata
from jvllm.attention.xla import decode_attention, paged_attention
from pallas_kernels.reference import decode_attention_reference


def _case(seqs: int, heads: int, kv_heads: int, head_dim: int, page: int, max_pages: int, cached: list[int],
          dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    num_pages = seqs * max_pages + 1
    k_pages = rng.standard_normal((num_pages, page, kv_heads, head_dim)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page, kv_heads, head_dim)).astype(np.float32)
    tables = (rng.permutation(num_pages - 1)[: seqs * max_pages] + 1).reshape(seqs, max_pages).astype(np.int32)
    q = rng.standard_normal((seqs, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((seqs, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((seqs, kv_heads, head_dim)).astype(np.float32)
    # The reference reads the own token from the pages: write it at position `cached` of a copy.
    k_ref, v_ref = k_pages.copy(), v_pages.copy()
    for s, c in enumerate(cached):
        k_ref[tables[s, c // page], c % page] = k[s]
        v_ref[tables[s, c // page], c % page] = v[s]
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), cast(k_pages), cast(v_pages), cast(k_ref), cast(v_ref), jnp.asarray(tables),
            jnp.asarray(cached, jnp.int32))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("max_pages", [1, 4, 7])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_matches_the_gather_reference(heads, kv_heads, max_pages, window):
    page = 8
    seqs = 5
    rng = np.random.default_rng(max_pages)
    # lengths from empty (a padding row) to the last slot of the table
    cached = [0, max_pages * page - 1, *rng.integers(0, max_pages * page, seqs - 2).tolist()]
    q, k, v, kp, vp, k_ref, v_ref, tables, cached_arr = _case(seqs, heads, kv_heads, 16, page, max_pages, cached,
                                                               jnp.float32)
    got = decode_attention(q, k, v, kp, vp, tables, cached_arr, 0.25, window)
    want = decode_attention_reference(q, k_ref, v_ref, tables, cached_arr + 1, scale=0.25, sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("max_pages, cached", [(8, 0), (8, 63), (12, 50), (48, 16 * 8 + 3), (48, 48 * 8 - 1)])
@pytest.mark.parametrize("window", [None, 20])
def test_single_sequence_decode_reads_many_pages_per_iteration_and_matches_the_reference(max_pages, cached, window):
    """One sequence takes up to 16 pages per loop iteration (12 pages: 4, 48 pages: 16); every span boundary,
    the skipped iterations past the context and the window still give the reference attention."""
    assert xla_backend.pages_per_iteration(1, max_pages) == {8: 8, 12: 4, 48: 16}[max_pages]
    q, k, v, kp, vp, k_ref, v_ref, tables, cached_arr = _case(1, 6, 2, 16, 8, max_pages, [cached], jnp.float32)
    got = decode_attention(q, k, v, kp, vp, tables, cached_arr, 0.25, window)
    want = decode_attention_reference(q, k_ref, v_ref, tables, cached_arr + 1, scale=0.25, sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_decode_attention_bf16_pool_is_close_to_f32():
    cached = [3, 17, 30]
    q, k, v, kp, vp, k_ref, v_ref, tables, cached_arr = _case(3, 8, 2, 64, 16, 2, cached, jnp.bfloat16)
    got = decode_attention(q, k, v, kp, vp, tables, cached_arr, 0.125)
    want = decode_attention_reference(q.astype(jnp.float32), k_ref.astype(jnp.float32), v_ref.astype(jnp.float32),
                                      tables, cached_arr + 1, scale=0.125)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seqs", [1, 5, 8])
def test_paged_attention_routes_decode_steps_through_the_page_loop(seqs, monkeypatch):
    """A decode-only step (one query slot per sequence, from one sequence up) with padded token rows: each
    real token gets its sequence's result, as the reference computes it."""
    loop_calls = []
    monkeypatch.setattr(xla_backend, "decode_attention",
                        lambda *args, **kw: loop_calls.append(1) or decode_attention(*args, **kw))
    cached = [9, 0, 20, 31, 1, 16, 15, 30][:seqs]
    q, k, v, kp, vp, k_ref, v_ref, tables, cached_arr = _case(seqs, 6, 3, 16, 8, 4, cached, jnp.float32)
    num_tokens = seqs + 1  # one token per sequence + one padding row
    pad = lambda a: jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])  # noqa: E731
    md = AttentionMetadata(
        slot_mapping=jnp.zeros(num_tokens, jnp.int32), query_start=jnp.arange(num_tokens, dtype=jnp.int32),
        q_lens=pad(jnp.ones(seqs, jnp.int32)), kv_lens=pad(cached_arr + 1), page_tables=pad(tables), decode=True)
    got = paged_attention(pad(q), pad(k), pad(v), kp, vp, md, 0.25)
    assert loop_calls == [1]
    want = decode_attention_reference(q, k_ref, v_ref, tables, cached_arr + 1, scale=0.25)
    np.testing.assert_allclose(np.asarray(got[:seqs]), np.asarray(want), atol=2e-5, rtol=2e-5)


STEPS = {  # (cached tokens, new tokens) per scheduled chunk
    "first_prefill_chunks": [(0, 21), (0, 6), (0, 16)],
    "mixed": [(0, 13), (35, 1), (17, 9), (3, 1)],
}


def _chunk_step(step: str, dtype):
    """A prefill step of STEPS[step] built as the runner builds it -> (q, k, v, k_pages, v_pages, md)."""
    from jvllm.attention import get_backend
    from jvllm.worker.batch import ChunkRow, build_batch
    from jvllm.worker.step_shapes import ShapeSet

    page, kv_heads, group, head_dim = 16, 3, 3, 32
    rng = np.random.default_rng(7)
    spans = STEPS[step]
    pages_needed = [-(-(cached + new) // page) for cached, new in spans]
    num_pages = 1 + sum(pages_needed) + 2
    free = (rng.permutation(num_pages - 1) + 1).tolist()
    chunks = []
    for (cached, new), count in zip(spans, pages_needed):
        table, free = free[:count], free[count:]
        chunks.append(ChunkRow([5] * new, cached, table))
    shape = ShapeSet(max_num_seqs=8, max_num_batched_tokens=64).prefill(sum(new for _, new in spans))
    batch = build_batch(chunks, shape, page, 16, get_backend("xla").prefill_layout)
    md = jax.tree.map(jnp.asarray, batch.metadata)
    tokens = md.slot_mapping.shape[0]
    pool_shape = (num_pages, page, kv_heads, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(pool_shape), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((tokens, kv_heads * group, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype) for _ in range(2))
    return q, k, v, k_pages, v_pages, md


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_paged_attention_of_chunk_steps_matches_the_ragged_reference(step, window, dtype):
    """Steps with prefill chunks against the reference over pages holding every token. bf16 also checks that
    XLA CPU can run the einsums' layouts (one order compiled to a dot it cannot run)."""
    from pallas_kernels.reference import ragged_attention_reference

    q, k, v, k_pages, v_pages, md = _chunk_step(step, dtype)
    got = jax.jit(paged_attention, static_argnums=(6, 7))(q, k, v, k_pages, v_pages, md, 0.2, window)
    want = ragged_attention_reference(
        q, xla_backend.write_kv(k_pages, k, md.slot_mapping), xla_backend.write_kv(v_pages, v, md.slot_mapping),
        md.query_start, md.q_lens, md.kv_lens, md.page_tables, max_q_len=q.shape[0], scale=0.2,
        sliding_window=window)
    real = sum(new for _, new in STEPS[step])
    tolerance = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[:real], np.float32), np.asarray(want[:real], np.float32),
                               atol=tolerance, rtol=tolerance)


def _bits(pages: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(pages, jnp.uint16)


def test_a_bf16_pool_stored_as_bits_gives_the_bf16_results():
    """The pool of a bf16 model is stored as uint16 bits (jvllm.attention.pool_storage): writing, a step with
    prefill chunks and the decode loop give exactly what the same pool in bfloat16 gives."""
    q, k, v, k_pages, v_pages, md = _chunk_step("mixed", jnp.bfloat16)
    written = xla_backend.write_kv(_bits(k_pages), k, md.slot_mapping)
    assert written.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(written), np.asarray(_bits(xla_backend.write_kv(k_pages, k,
                                                                                              md.slot_mapping))))
    step = jax.jit(paged_attention, static_argnums=(6,))
    np.testing.assert_array_equal(np.asarray(step(q, k, v, _bits(k_pages), _bits(v_pages), md, 0.2), np.float32),
                                  np.asarray(step(q, k, v, k_pages, v_pages, md, 0.2), np.float32))

    q, k, v, kp, vp, _, _, tables, cached = _case(3, 8, 2, 64, 16, 2, [3, 17, 30], jnp.bfloat16)
    loop = jax.jit(decode_attention, static_argnums=(7,))
    np.testing.assert_array_equal(np.asarray(loop(q, k, v, _bits(kp), _bits(vp), tables, cached, 0.125)),
                                  np.asarray(loop(q, k, v, kp, vp, tables, cached, 0.125)))


def test_a_bits_pool_round_trips_its_values_and_leaves_float32_alone():
    from jvllm.attention import pool_storage

    values = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.bfloat16)
    assert pool_storage.storage_dtype(jnp.bfloat16) == jnp.uint16
    assert pool_storage.value_dtype(jnp.uint16) == jnp.bfloat16
    stored = pool_storage.as_stored(values.astype(jnp.float32), jnp.uint16)
    assert stored.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(pool_storage.as_values(stored), np.float32), np.asarray(values, np.float32))
    assert pool_storage.storage_dtype(jnp.float32) == pool_storage.value_dtype(jnp.float32) == jnp.float32
    assert pool_storage.as_stored(values, jnp.float32).dtype == jnp.float32
