"""Random inputs for the Pallas kernel tests: small page pools, scrambled block tables, NaN-poisoned slack."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention import AttentionBackend
from jvllm.worker.batch import ChunkRow, build_batch
from jvllm.worker.step_shapes import ShapeSet, StepShape
from models.attention import AttentionMetadata

TOLERANCE = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclasses.dataclass
class Pool:
    k_pages: jnp.ndarray  # [N, page, KVH, hd]
    v_pages: jnp.ndarray  # [N, page, KVH, hd]
    block_tables: jnp.ndarray  # [S, P] int32, pages in scrambled order, 0 when padded


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> jnp.ndarray:
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def scrambled_tables(rng: np.random.Generator, kv_lens: list[int], page_size: int, max_pages: int,
                     num_pages: int) -> np.ndarray:
    """[S, max_pages] int32: each sequence gets distinct pages (never page 0) in random order."""
    needed = [-(-n // page_size) for n in kv_lens]
    free = rng.permutation(np.arange(1, num_pages))
    assert sum(needed) <= len(free) and max(needed) <= max_pages
    tables = np.zeros((len(kv_lens), max_pages), np.int32)
    cursor = 0
    for row, count in enumerate(needed):
        tables[row, :count] = free[cursor:cursor + count]
        cursor += count
    return tables


def make_pool(rng: np.random.Generator, kv_lens: list[int], *, page_size: int, kv_heads: int, head_dim: int,
              dtype, max_pages: int | None = None, spare_pages: int = 2, poison: bool = True) -> Pool:
    """Random pages; with `poison`, every slot no sequence owns (page 0, unused pages, tails of last pages)
    holds NaN, so a kernel that reads past a sequence's length shows it."""
    max_pages = max_pages or max(1, max(-(-n // page_size) for n in kv_lens))
    num_pages = 1 + sum(-(-n // page_size) for n in kv_lens) + spare_pages
    tables = scrambled_tables(rng, kv_lens, page_size, max_pages, num_pages)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages, v_pages = random_array(rng, shape, jnp.float32), random_array(rng, shape, jnp.float32)
    if poison:
        owned = np.zeros((num_pages, page_size), bool)
        for row, length in enumerate(kv_lens):
            for pos in range(length):
                owned[tables[row, pos // page_size], pos % page_size] = True
        mask = jnp.asarray(owned)[:, :, None, None]
        k_pages, v_pages = jnp.where(mask, k_pages, jnp.nan), jnp.where(mask, v_pages, jnp.nan)
    return Pool(k_pages.astype(dtype), v_pages.astype(dtype), jnp.asarray(tables))


@dataclasses.dataclass
class RaggedBatch:
    q: jnp.ndarray  # [T, H, hd]
    query_start: jnp.ndarray  # [S]
    q_lens: jnp.ndarray  # [S]
    kv_lens: jnp.ndarray  # [S]
    real_tokens: int  # sum(q_lens); rows after it are padding


def ragged_batch(rng: np.random.Generator, q_lens: list[int], kv_lens: list[int], num_tokens: int, heads: int,
                 head_dim: int, dtype) -> RaggedBatch:
    """Sequences back to back in a flat batch of `num_tokens` (>= sum(q_lens)); q_len 0 rows are padding."""
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    starts = np.where(np.asarray(q_lens) > 0, starts, 0)
    assert sum(q_lens) <= num_tokens
    return RaggedBatch(random_array(rng, (num_tokens, heads, head_dim), dtype), jnp.asarray(starts, jnp.int32),
                       jnp.asarray(q_lens, jnp.int32), jnp.asarray(kv_lens, jnp.int32), sum(q_lens))


def step_shape(chunks: list[tuple[int, int]], shapes: ShapeSet) -> StepShape:
    """The shape the engine runs chunks of (cached tokens, new tokens) in: a decode step when every chunk is
    one token, else the smallest prefill step that holds them all."""
    if all(n == 1 for _, n in chunks):
        return shapes.decode(len(chunks))
    return shapes.prefill(sum(n for _, n in chunks))


def engine_metadata(chunks: list[tuple[int, int]], page_size: int, num_pages: int, rng: np.random.Generator,
                    shapes: ShapeSet, max_pages: int,
                    backend: AttentionBackend) -> tuple[AttentionMetadata, int]:
    """Metadata exactly as the engine builds it for chunks of (cached tokens, new tokens) in their step shape,
    with `backend`'s prefill layout (the backend set up for the model: `for_model`) and each request's pages
    drawn at random from 1..num_pages-1 -> (device metadata, real token count)."""
    total_pages = [-(-(start + n) // page_size) for start, n in chunks]
    free = rng.permutation(np.arange(1, num_pages))
    assert sum(total_pages) <= len(free)
    rows, cursor = [], 0
    for (start, n), count in zip(chunks, total_pages):
        rows.append(ChunkRow([0] * n, start, [int(p) for p in free[cursor:cursor + count]]))
        cursor += count
    host = build_batch(rows, step_shape(chunks, shapes), page_size, max_pages, backend.prefill_layout)
    return jax.device_put(host.metadata), sum(n for _, n in chunks)
