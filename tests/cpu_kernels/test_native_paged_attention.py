"""The native CPU paged attention (cpu_kernels) against the pure-jnp reference of the Pallas kernels.

The reference reads every key from the pages; the native kernel reads cached keys from the pages and the step's
own keys from its k/v arguments, so the pages it gets hold NaN wherever this step's tokens go: a kernel that reads
a page slot it should take from k/v (or any slot no sequence owns) shows NaN. The writing variant (the `cpu`
backend's) must return the pages with exactly the step's K/V stored at their slots, and the same attention (its
few-query loops read the step's own K/V from the pages it wrote, so over bfloat16 pages the bits may differ)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels.paged_attention import (bf16_prefill_tiles, e5m2_to_bf16_bits, paged_attention,
                                         paged_attention_write)
from pallas_kernels.reference import ragged_attention_reference

TOLERANCE = dict(atol=2e-5, rtol=2e-5)  # float32 throughout; bfloat16 pools hold values the reference sees too
# paged_attention.cc's kBlockQueries, kDirectRows, kDirectQueries: a sequence's queries go in blocks of 32, and a block
# of more than 8 queries (and 4 rows) over a bfloat16 pool goes through the bf16 tiles on machines with AVX-512 BF16
BLOCK_QUERIES, DIRECT_ROWS, DIRECT_QUERIES = 32, 4, 8


def tiled_tokens(q_lens: list[int], group: int) -> np.ndarray:
    """[tokens] whether each token's query block is attended in bf16 tiles (when the build has them)."""
    tiled = []
    for n in q_lens:
        for i in range(n):
            count = min(BLOCK_QUERIES, n - i // BLOCK_QUERIES * BLOCK_QUERIES)
            tiled.append(count > DIRECT_QUERIES and count * group > DIRECT_ROWS)
    return np.asarray(tiled, bool)


def test_kernels_build_here():
    """CI has a C++ compiler: the kernels must build, not silently fall back."""
    assert build.available(), "cpu_kernels did not build"
    assert build.load() is build.load()


def test_e5m2_pages_read_as_the_bfloat16_of_their_values():
    """Every e5m2 byte, in runs of every length and start (the 32-value vector steps and the scalar rest, a
    subnormal, infinity or NaN in a step or not), reads as the bfloat16 of its value; NaN stays NaN."""
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(E5M2).astype(jnp.bfloat16).view(np.uint16)
    normal = codes[((codes & 0x7F) >= 4) & ((codes & 0x7F) < 0x7C)]
    rng = np.random.default_rng(5)
    runs = [codes, np.tile(normal, 3)] + [rng.permutation(codes)[:n] for n in (1, 15, 16, 17, 31, 32, 33, 64, 97)]
    for run in runs:
        for start in (0, 1, 7):
            got = e5m2_to_bf16_bits(run[start:])
            want = expected[run[start:]]
            nan = np.isnan(want.view(jnp.bfloat16).astype(np.float32))
            np.testing.assert_array_equal(got[~nan], want[~nan])
            assert np.isnan(got[nan].view(jnp.bfloat16).astype(np.float32)).all()


def random_array(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def as_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the bfloat16 pool's uint16 storage (rounded to nearest even)."""
    return np.asarray(x, np.float32).astype(jnp.bfloat16).view(np.uint16)


E5M2 = jnp.float8_e5m2
POOL_DTYPES = [jnp.float32, jnp.bfloat16, E5M2]


def as_pool(x: np.ndarray, pool_dtype) -> np.ndarray:
    """float32 values -> what the cpu backend's pool of `pool_dtype` holds for them (bfloat16 as its bits)."""
    if pool_dtype == jnp.bfloat16:
        return as_bf16_bits(x)
    return np.asarray(x, np.float32).astype(pool_dtype)


def pool_values(x: np.ndarray, pool_dtype) -> np.ndarray:
    """float32 values -> the values a pool of `pool_dtype` keeps of them, in float32."""
    return np.asarray(x, np.float32).astype(pool_dtype).astype(np.float32)


# The test's inputs are built in numpy and the reference runs jitted: each eager jnp op on a new shape is a compile
# of its own (~20 of them per case, most of a case's time).
reference = jax.jit(ragged_attention_reference, static_argnames=("scale", "sliding_window", "soft_cap"))


def make_pool(rng: np.random.Generator, kv_lens: list[int], page_size: int, kv_heads: int, head_dim: int):
    """-> (k_pages, v_pages [N, page, KVH, hd], tables [S, P]): each sequence's pages distinct, scrambled, never
    page 0; every slot no sequence owns holds NaN."""
    needed = [-(-n // page_size) for n in kv_lens]
    num_pages = 1 + sum(needed) + 2
    free = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(kv_lens), max(needed)), np.int32)
    owned = np.zeros((num_pages, page_size), bool)
    cursor = 0
    for row, (count, length) in enumerate(zip(needed, kv_lens)):
        tables[row, :count] = free[cursor:cursor + count]
        cursor += count
        for pos in range(length):
            owned[tables[row, pos // page_size], pos % page_size] = True
    mask = owned[:, :, None, None]
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages, v_pages = (np.where(mask, random_array(rng, shape), np.float32(np.nan)) for _ in range(2))
    return k_pages, v_pages, tables


def run_case(rng, chunks: list[tuple[int, int]], *, heads: int, kv_heads: int, head_dim: int, page_size: int,
             pool_dtype=jnp.float32, padding_rows: int = 0, padding_tokens: int = 0, sliding_window=None,
             soft_cap=None, bf16_tiles: bool = True):
    """chunks: (cached tokens, tokens this step) per sequence. Compares the kernel with the reference."""
    kv_lens = [cached + new for cached, new in chunks]
    full_k, full_v, block_tables = make_pool(rng, kv_lens, page_size, kv_heads, head_dim)
    q_lens = [new for _, new in chunks]
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    num_tokens = sum(q_lens) + padding_tokens
    q = random_array(rng, (num_tokens, heads, head_dim))

    rows = np.zeros((num_tokens, 2), np.int32)  # (page, offset) of each token; padding tokens: page 0
    for s, (cached, new) in enumerate(chunks):
        for i in range(new):
            pos = cached + i
            rows[starts[s] + i] = (block_tables[s, pos // page_size], pos % page_size)

    # the reference sees the values the pool keeps (rounded to bfloat16 or e5m2), in float32
    k_pages, v_pages = (pool_values(p, pool_dtype) for p in (full_k, full_v))
    k, v = k_pages[rows[:, 0], rows[:, 1]], v_pages[rows[:, 0], rows[:, 1]]  # [T, KVH, hd] each token's own K, V

    pad = lambda a: np.concatenate([np.asarray(a, np.int32), np.zeros(padding_rows, np.int32)])  # noqa: E731
    tables = np.concatenate([block_tables, np.zeros((padding_rows, block_tables.shape[1]), np.int32)])
    query_start, q_len, kv_len = pad(starts), pad(q_lens), pad(kv_lens)
    expected = np.asarray(reference(q, k_pages, v_pages, query_start, q_len, kv_len, tables, scale=head_dim ** -0.5,
                                    sliding_window=sliding_window, soft_cap=soft_cap))
    # bf16 tiles (prefill blocks over bf16 or 8-bit pages) and the few-query loops over 8-bit pages round the scaled
    # queries to bfloat16 (the reference gets them so), and the probabilities, each within 2^-9 of itself: an output
    # moves by at most 2^-9 of the largest |value|
    block_shaped = np.zeros(num_tokens, bool)  # the tokens a prefill block holds (the rest: few-query loops)
    block_shaped[:sum(q_lens)] = tiled_tokens(q_lens, heads // kv_heads)
    bf16_dots = head_dim % 32 == 0 and bf16_prefill_tiles()
    in_tiles = block_shaped & (bf16_tiles and pool_dtype != jnp.float32 and soft_cap is None and bf16_dots)
    scaled_parts = np.zeros(num_tokens, bool)  # few-query loops over 8-bit pages
    scaled_parts[:sum(q_lens)] = pool_dtype == E5M2 and bf16_dots
    scaled_parts &= ~block_shaped
    rounded_queries = in_tiles | scaled_parts
    if rounded_queries.any():
        rounded = (q * np.float32(head_dim ** -0.5)).astype(jnp.bfloat16).astype(np.float32)
        expected_rounded = np.asarray(reference(rounded, k_pages, v_pages, query_start, q_len, kv_len, tables,
                                                scale=1.0, sliding_window=sliding_window, soft_cap=soft_cap))
        loose = dict(atol=2 ** -9 * float(np.nanmax(np.abs(v_pages))) + 2e-5, rtol=0)

    poisoned = np.zeros(k_pages.shape[:2], bool)  # this step's slots: the kernel must take them from k/v
    for s, (cached, new) in enumerate(chunks):
        for pos in range(cached, cached + new):
            poisoned[block_tables[s, pos // page_size], pos % page_size] = True
    mask = poisoned[:, :, None, None]
    k_in, v_in = np.where(mask, np.float32(np.nan), k_pages), np.where(mask, np.float32(np.nan), v_pages)
    k_in, v_in = as_pool(k_in, pool_dtype), as_pool(v_in, pool_dtype)  # bfloat16: as bits, as the cpu backend

    got = np.asarray(jax.jit(paged_attention, static_argnames=("scale", "sliding_window", "soft_cap", "bf16_tiles"))(
        q, k, v, k_in, v_in, query_start, q_len, kv_len, tables, scale=head_dim ** -0.5,
        sliding_window=sliding_window, soft_cap=soft_cap, bf16_tiles=bf16_tiles))
    assert got.shape == q.shape and got.dtype == np.float32
    np.testing.assert_allclose(got[~rounded_queries], expected[~rounded_queries], **TOLERANCE)
    if rounded_queries.any():
        np.testing.assert_allclose(got[rounded_queries], expected_rounded[rounded_queries], **loose)
    if padding_tokens:
        assert not got[sum(q_lens):].any(), "padding tokens must come back as zeros"

    slots = rows[:, 0] * page_size + rows[:, 1]
    slots[sum(q_lens):] = -1  # padding tokens: outside the pool, not written
    stored = (as_pool(k, pool_dtype), as_pool(v, pool_dtype))
    written, k_out, v_out = jax.jit(paged_attention_write,
                                    static_argnames=("scale", "sliding_window", "soft_cap", "bf16_tiles"))(
        q, k, v, *stored, k_in, v_in, query_start, q_len, kv_len, tables, slots, scale=head_dim ** -0.5,
        sliding_window=sliding_window, soft_cap=soft_cap, bf16_tiles=bf16_tiles)
    written = np.asarray(written)
    if pool_dtype == jnp.float32:
        np.testing.assert_array_equal(written, got)
    else:  # the direct loops read the step's own K/V from the pages it wrote (bf16 dot products, as for cached keys)
        np.testing.assert_allclose(written[~rounded_queries], expected[~rounded_queries], **TOLERANCE)
        np.testing.assert_array_equal(written[in_tiles], got[in_tiles])
        if scaled_parts.any():
            np.testing.assert_allclose(written[scaled_parts], expected_rounded[scaled_parts], **loose)
    for full, given, out in ((k_pages, k_in, k_out), (v_pages, v_in, v_out)):
        np.testing.assert_array_equal(
            np.asarray(out).view(np.uint8), np.where(mask, as_pool(full, pool_dtype), given).view(np.uint8))
    if pool_dtype == jnp.bfloat16:  # float32 K/V for bf16 pages: rounded as written, the bits of jnp's rounding
        rng = np.random.default_rng(num_tokens)
        k_f, v_f = (np.asarray(a, np.float32) * (1 + rng.uniform(-0.01, 0.01, np.shape(a))).astype(np.float32)
                    for a in (k, v))  # values between bfloat16's, so the rounding matters
        step = jax.jit(paged_attention_write, static_argnames=("scale", "sliding_window", "soft_cap", "bf16_tiles"))
        common = (k_in, v_in, query_start, q_len, kv_len, tables, slots)
        options = dict(scale=head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap, bf16_tiles=bf16_tiles)
        by_bits = step(q, k_f, v_f, as_bf16_bits(k_f), as_bf16_bits(v_f), *common, **options)
        by_floats = step(q, k_f, v_f, k_f, v_f, *common, **options)
        for a, b in zip(by_floats, by_bits):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


MIXED = [(0, 5), (3, 17), (40, 64), (100, 1), (0, 33), (70, 90)]  # fresh, chunked, decode rows, > 64 keys


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (8, 1), (9, 3)])
def test_prefill_and_decode_mix(head_dim, heads, kv_heads):
    run_case(np.random.default_rng(head_dim * heads + kv_heads), MIXED, heads=heads, kv_heads=kv_heads,
             head_dim=head_dim, page_size=16)


@pytest.mark.parametrize("page_size", [16, 24, 32])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_pages_and_pool_dtypes(page_size, pool_dtype):
    run_case(np.random.default_rng(page_size), MIXED, heads=8, kv_heads=2, head_dim=64, page_size=page_size,
             pool_dtype=pool_dtype, padding_rows=3, padding_tokens=11)


@pytest.mark.parametrize("seqs", [1, 2, 5, 32])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_decode_rows(seqs, pool_dtype):
    """One token per sequence, as a decode step lays them out (some threads get a single row, or a single head)."""
    rng = np.random.default_rng(seqs)
    chunks = [(int(c), 1) for c in rng.integers(0, 300, seqs)]
    run_case(rng, chunks, heads=9, kv_heads=3, head_dim=64, page_size=16, pool_dtype=pool_dtype, padding_rows=2)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (8, 2), (20, 2)])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_decode_rows_per_kv_head(heads, kv_heads, head_dim):
    """Decode rows read a bfloat16 pool in place with 1-4 (and 10) query heads per KV head, over key counts that leave
    every remainder of the four-key passes, of the key pairs and of AMX's 16-key groups (10 query heads: two passes of
    the tiles' 8 rows), and head sizes that leave one of the value passes, or do not fit the bf16 loops' 32-value
    chunks."""
    rng = np.random.default_rng(heads * head_dim + kv_heads)
    chunks = [(c, 1) for c in (0, 1, 2, 3, 62, 63, 64, 65, 130)]
    run_case(rng, chunks, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=16, pool_dtype=jnp.bfloat16)


@pytest.mark.parametrize("head_dim", [16, 48, 80])
def test_eight_bit_pages_under_head_sizes_the_bf16_loops_do_not_take(head_dim):
    """Head sizes that are not a multiple of 32 read 8-bit pages through the float loops, each row widened to floats
    in place: decode rows, verification rows and prefill blocks."""
    rng = np.random.default_rng(head_dim)
    chunks = [(0, 1), (3, 1), (70, 1), (130, 5), (40, 17), (0, 40)]
    run_case(rng, chunks, heads=8, kv_heads=2, head_dim=head_dim, page_size=16, pool_dtype=E5M2)


@pytest.mark.parametrize("contexts", [(2100,), (300, 1000), (255, 256, 257, 511, 512, 513, 1000, 2100)])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_decode_rows_over_key_spans(contexts, pool_dtype):
    """Decode rows whose keys go past one span (page_view.h kSpanKeys): each span is a work item of its own and the
    spans' sums are merged, for a lone row (its heads split over items too) and for rows together."""
    rng = np.random.default_rng(len(contexts))
    run_case(rng, [(c, 1) for c in contexts], heads=9, kv_heads=3, head_dim=64, page_size=16, pool_dtype=pool_dtype)


@pytest.mark.parametrize("window", [100, 300, 700])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_sliding_window_over_key_spans(window, pool_dtype):
    """Spanned decode and verification rows under a sliding window: spans before the window have nothing visible,
    a window edge inside a span masks part of it."""
    run_case(np.random.default_rng(window), [(900, 1), (600, 4), (260, 1), (1500, 8)], heads=8, kv_heads=4,
             head_dim=64, page_size=16, sliding_window=window, pool_dtype=pool_dtype)


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_verification_rows(pool_dtype):
    """2-8 tokens after a cached context, as a speculative verification step lays out a decode row and its drafts
    (read in place like decode rows)."""
    rng = np.random.default_rng(8)
    chunks = [(int(c), int(n)) for c, n in zip(rng.integers(0, 200, 7), range(2, 9))]
    run_case(rng, chunks, heads=9, kv_heads=3, head_dim=64, page_size=16, pool_dtype=pool_dtype)


@pytest.mark.parametrize("chunk", [(150, 6), (37, 3), (64, 8), (5, 2), (254, 4), (700, 6), (1000, 6)])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_a_lone_verification_row(chunk, pool_dtype):
    """One sequence verifying drafts alone (single-stream speculative decoding): its queries are split over work
    items in two halves, or (1,000 keys: four spans, two a thread on two threads) one item per span takes them
    all."""
    run_case(np.random.default_rng(9), [chunk], heads=9, kv_heads=3, head_dim=64, page_size=16,
             pool_dtype=pool_dtype)


# 253 + 6 and 511 + 2 cross a span edge (page_view.h kSpanKeys) among the queries; 700 has three spans, 1,020 four
# (its queries not split in halves where the kernels run two threads)
@pytest.mark.parametrize("cached, drafts, direct_queries", [
    (150, 5, 8), (37, 2, 8), (64, 7, 8), (5, 3, 8), (126, 1, 8), (253, 5, 8), (511, 1, 8), (700, 7, 8), (1020, 5, 8),
    (240, 20, 32), (700, 31, 32), (3, 12, 32), (100, 15, 16)])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_a_verification_row_gives_the_bits_of_the_decode_row(cached, drafts, direct_queries, pool_dtype):
    """A sequence's last token and its draft tokens attended in one step (the writing variant, as the engine runs it)
    give each query the same bits as decode steps of one token each over the same pages: speculative decoding's
    greedy tokens are then those without it. Up to 8 queries by default; more where the call raises
    `direct_queries`."""
    rng = np.random.default_rng(cached + drafts)
    heads, kv_heads, head_dim, page_size, tokens = 9, 3, 64, 16, 32
    count = drafts + 1
    k_all, v_all = (random_array(rng, (cached + count, kv_heads, head_dim)) for _ in range(2))
    q_all = random_array(rng, (count, heads, head_dim))
    pages = -(-(cached + count) // page_size)
    table = rng.permutation(np.arange(1, pages + 3))[:pages][None].astype(np.int32)
    slot_of = np.array([int(table[0, p // page_size]) * page_size + p % page_size for p in range(cached + count)])
    stored = lambda x: as_pool(x, pool_dtype)  # noqa: E731
    shape = (pages + 3, page_size, kv_heads, head_dim)

    def cached_pool(x: np.ndarray) -> np.ndarray:  # [cached + count, KVH, hd] -> the pool holding the cached tokens
        flat = np.zeros((shape[0] * page_size, kv_heads, head_dim), np.float32)
        flat[slot_of[:cached]] = x[:cached]
        return stored(flat.reshape(shape))

    k_pages, v_pages = cached_pool(k_all), cached_pool(v_all)
    step = jax.jit(paged_attention_write,
                   static_argnames=("scale", "sliding_window", "soft_cap", "bf16_tiles", "direct_queries"))

    def run(first: int, n: int, k_pages, v_pages):
        def pad(x: np.ndarray) -> np.ndarray:  # [n, ...] -> [tokens, ...]
            return np.concatenate([x, np.zeros((tokens - n, *x.shape[1:]), x.dtype)])

        q = pad(q_all[first - cached:first - cached + n])
        k, v = pad(k_all[first:first + n]), pad(v_all[first:first + n])
        slots = np.concatenate([slot_of[first:first + n], -np.ones(tokens - n, np.int64)]).astype(np.int32)
        return step(q, k, v, stored(k), stored(v), k_pages, v_pages, np.zeros(1, np.int32), np.full(1, n, np.int32),
                    np.full(1, first + n, np.int32), table, slots, scale=head_dim ** -0.5, bf16_tiles=True,
                    direct_queries=direct_queries)

    verified = np.asarray(run(cached, count, k_pages, v_pages)[0])
    for i in range(count):
        decoded, k_pages, v_pages = run(cached + i, 1, k_pages, v_pages)
        np.testing.assert_array_equal(np.asarray(decoded)[0], verified[i], err_msg=f"query {i}")


@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_sliding_window(window, pool_dtype):
    run_case(np.random.default_rng(window), MIXED, heads=8, kv_heads=4, head_dim=64, page_size=16,
             sliding_window=window, pool_dtype=pool_dtype)


@pytest.mark.parametrize("cap", [2.0, 50.0])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_soft_cap(cap, pool_dtype):
    run_case(np.random.default_rng(int(cap)), MIXED, heads=8, kv_heads=4, head_dim=128, page_size=16, soft_cap=cap,
             sliding_window=20, pool_dtype=pool_dtype)


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_long_prompt_in_blocks(pool_dtype):
    """A 300-token chunk after 200 cached tokens: many query blocks and key blocks of one sequence."""
    run_case(np.random.default_rng(7), [(200, 300)], heads=4, kv_heads=2, head_dim=64, page_size=16,
             pool_dtype=pool_dtype)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1), (9, 3), (16, 2)])
def test_prefill_blocks_over_bf16_pages(head_dim, heads, kv_heads):
    """Prefill chunks of 9-100 tokens, fresh and after cached contexts, over a bfloat16 pool: every remainder of the
    tiles' 16-row chunks, four-key groups and key pairs, blocks that straddle the causal diagonal, with 1-8 query
    heads per KV head (head sizes the bf16 tiles do not take run the float loops)."""
    rng = np.random.default_rng(head_dim + heads * kv_heads)
    chunks = [(0, 9), (0, 37), (5, 63), (64, 64), (17, 100), (130, 33), (1, 10)]
    run_case(rng, chunks, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=16, pool_dtype=jnp.bfloat16)


def test_the_vector_loops_where_amx_takes_their_work():
    """On CPUs with AMX the products of prefill blocks and of few-query rows over bf16 pages run on the tile unit
    (cpu_kernels/amx_prefill_attention.h, amx_decode_attention.h); the AVX-512 BF16 loops they replace
    (JVLLM_CPU_AMX=0, in a subprocess) must still pass the same cases, a verification row's bits included."""
    from cpu_kernels.bf16_rows import amx_products

    if not amx_products():
        pytest.skip("no AMX here: the cases above ran the vector loops")
    cases = [f"{__file__}::{name}" for name in (
        "test_prefill_blocks_over_bf16_pages", "test_long_prompt_in_blocks", "test_decode_rows_per_kv_head",
        "test_decode_rows_over_key_spans", "test_a_verification_row_gives_the_bits_of_the_decode_row")]
    env = {**os.environ, "JVLLM_CPU_AMX": "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not float32", *cases],
                          env=env,
                          cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]


def test_prefill_over_bf16_pages_without_tiles():
    """A call that does not allow the bf16 tiles keeps float32 queries and probabilities: float32's tolerance."""
    chunks = [(0, 40), (17, 100), (130, 33)]
    run_case(np.random.default_rng(3), chunks, heads=9, kv_heads=3, head_dim=64, page_size=16,
             pool_dtype=jnp.bfloat16, bf16_tiles=False)


def test_head_dim_not_a_multiple_of_16():
    q = jnp.zeros((2, 2, 24), jnp.float32)
    pages = jnp.zeros((2, 16, 2, 24), jnp.float32)
    ints = jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_attention(q, q, q, pages, pages, ints, ints, ints, jnp.zeros((1, 1), jnp.int32), 1.0)
