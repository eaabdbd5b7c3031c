"""The kernel variants the engine can launch (kernel, head dim, page size, dtype, GQA group), as lowerable calls."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.kv_write import write_kv
from pallas_kernels.ragged_attention import ragged_block_q, ragged_paged_attention

KERNELS = ("decode", "ragged", "kv_write")
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32)
DTYPES = ("bfloat16", "float32")
GROUPS = tuple(range(1, 9))  # query heads per KV head
# Kernel names in the lowered HLO (pallas_call's `name`)
KERNEL_NAMES = {"decode": "jvllm_decode_attention", "ragged": "jvllm_ragged_paged_attention",
                "kv_write": "jvllm_write_kv"}

# Step-sized shapes: 64 decode sequences over 2k-token block tables, a 512-token prefill of 8 sequences
KV_HEADS, POOL_PAGES = 8, 512
DECODE_SEQS, DECODE_CONTEXT = 64, 2048
PREFILL_TOKENS, PREFILL_SEQS = 512, 8


@dataclasses.dataclass(frozen=True)
class Variant:
    kernel: str  # one of KERNELS
    head_dim: int
    page_size: int
    dtype: str  # of the query and the pool
    group: int = 1  # GQA group (unused by kv_write)
    sliding_window: int | None = None  # the engine's one attention option (Mistral-style models)

    @property
    def id(self) -> str:
        options = "-window" if self.sliding_window else ""
        group = "" if self.kernel == "kv_write" else f"-g{self.group}"
        return f"{self.kernel}-{self.dtype}-hd{self.head_dim}-p{self.page_size}{group}{options}"

    def call(self) -> tuple[Callable, tuple[jax.ShapeDtypeStruct, ...]]:
        """(fn, argument specs) with compiled (not interpreted) kernels and every launch setting at its default."""
        dtype = jnp.dtype(self.dtype)
        pool = _spec(POOL_PAGES, self.page_size, KV_HEADS, self.head_dim, dtype=dtype)
        options = dict(sliding_window=self.sliding_window)
        scale = self.head_dim ** -0.5
        heads = KV_HEADS * self.group
        if self.kernel == "decode":
            max_pages = DECODE_CONTEXT // self.page_size
            fn = functools.partial(decode_attention, scale=scale, interpret=False, **options)
            return fn, (_spec(DECODE_SEQS, heads, self.head_dim, dtype=dtype), pool, pool,
                        _spec(DECODE_SEQS, max_pages), _spec(DECODE_SEQS))
        if self.kernel == "ragged":
            max_pages = PREFILL_TOKENS // self.page_size
            block_q = ragged_block_q(dtype, dtype, heads, KV_HEADS, self.head_dim)
            items = _spec(common.cdiv(PREFILL_TOKENS, block_q) + PREFILL_SEQS)  # item_seq, item_first
            fn = functools.partial(ragged_paged_attention, scale=scale, interpret=False, **options)
            return fn, (_spec(PREFILL_TOKENS, heads, self.head_dim, dtype=dtype), pool, pool,
                        _spec(PREFILL_SEQS), _spec(PREFILL_SEQS), _spec(PREFILL_SEQS),
                        _spec(PREFILL_SEQS, max_pages), items, items)
        new = _spec(PREFILL_TOKENS, KV_HEADS, self.head_dim, dtype=dtype)
        fn = functools.partial(write_kv, method="kernel", interpret=False)
        return fn, (pool, pool, new, new, _spec(PREFILL_TOKENS))


def _spec(*shape: int, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def all_variants() -> list[Variant]:
    """Every attention variant (both kernels x head dims x page sizes x dtypes x groups 1-8), one KV write per
    head dim, page size and dtype, and a sliding window per kernel, head dim, page size and dtype (GQA 4).
    Soft capping is a kernel option the engine never passes; it is not a variant here."""
    out = [Variant(kernel, hd, page, dtype, group) for kernel in ("decode", "ragged") for hd in HEAD_DIMS
           for page in PAGE_SIZES for dtype in DTYPES for group in GROUPS]
    out += [Variant("kv_write", hd, page, dtype) for hd in HEAD_DIMS for page in PAGE_SIZES for dtype in DTYPES]
    out += [Variant(kernel, hd, page, dtype, 4, sliding_window=1024) for kernel in ("decode", "ragged")
            for hd in HEAD_DIMS for page in PAGE_SIZES for dtype in DTYPES]
    return out


def compile_variants() -> list[Variant]:
    """The variants that compile to different machine code. Groups that pad to the same rows and mask alike
    differ only in a constant: for the ragged kernel 1, 2, 3 (padded to 4), 4, 6 (padded to 8) and 8 stand for
    1-8; the decode kernel pads every group up to 8 to 16 rows, so 1, 3 and 8 stand for all."""
    stand_ins = {"decode": (1, 3, 8), "ragged": (1, 2, 3, 4, 6, 8), "kv_write": (1,)}
    return [v for v in all_variants() if v.group in stand_ins[v.kernel]]
