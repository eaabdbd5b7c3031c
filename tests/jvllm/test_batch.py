"""build_batch's buckets: decode-only steps pad their page tables to DECODE_MIN_CONTEXT_TOKENS."""
from __future__ import annotations

import pytest

from jvllm import Engine, SamplingParams
from jvllm.attention import get_backend
from jvllm.utils import cdiv
from jvllm.worker.batch import DECODE_MIN_CONTEXT_TOKENS, BucketLimits, ChunkRow, build_batch

PAGE = 16
IN_STEP_WRITE = get_backend("pallas").table_pages  # tables list every page of the chunk
SEPARATE_WRITE = get_backend("xla").table_pages  # tables list only the pages cached before the step


def chunk(cached: int, new: int) -> ChunkRow:
    """A chunk of `new` tokens after `cached` ones, with the pages it needs (ids from 1)."""
    return ChunkRow([7] * new, cached, list(range(1, cdiv(cached + new, PAGE) + 1)))


def table_width(chunks: list, max_pages: int = 256) -> int:
    return build_batch(chunks, PAGE, BucketLimits(2048, 64, max_pages), IN_STEP_WRITE).metadata.page_tables.shape[1]


def test_a_decode_step_covers_the_minimum_context_whatever_its_length():
    assert DECODE_MIN_CONTEXT_TOKENS // PAGE == 8
    for cached in (5, 20, 40, 127):
        assert table_width([chunk(cached, 1), chunk(3, 1)]) == 8


def test_longer_decode_contexts_and_prefill_keep_the_power_of_two_buckets():
    assert table_width([chunk(9 * PAGE, 1)]) == 16  # 10 pages -> 16
    assert table_width([chunk(0, 5)]) == 1  # a prefill chunk pads to its own pages only
    assert table_width([chunk(40, 4), chunk(30, 1)]) == 4  # a mixed step (max_q > 1) too: 3 pages -> 4


def test_first_prefill_chunks_gather_no_context_pages_on_the_split_backend():
    chunks = [chunk(0, 40), chunk(0, 7)]
    batch = build_batch(chunks, PAGE, BucketLimits(2048, 64, 256), SEPARATE_WRITE)
    assert batch.metadata.page_tables.shape == (2, 0)
    assert list(batch.metadata.slot_mapping[:3]) == [PAGE, PAGE + 1, PAGE + 2]  # tokens still go to their pages
    with_cached = build_batch([chunk(0, 40), chunk(20, 7)], PAGE, BucketLimits(2048, 64, 256), SEPARATE_WRITE)
    assert with_cached.metadata.page_tables.shape == (2, 2)  # 20 cached tokens: 2 pages


def test_the_minimum_never_passes_the_longest_sequence():
    assert table_width([chunk(5, 1)], max_pages=4) == 4


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_a_short_generation_compiles_one_decode_shape(tiny_llama):
    """A 6-token prompt growing to 46 tokens: one decode shape (it used to need 1, 2 and 4 pages)."""
    engine = Engine(tiny_llama, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (out,) = engine.generate({"prompt_token_ids": list(range(100, 106))}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 40
    decode_shapes = {key[1:5] for key in engine.runner.compiled_shapes if key[3] == 1}  # (tokens, seqs, max_q, pages)
    assert decode_shapes == {(1, 1, 1, 8)}
