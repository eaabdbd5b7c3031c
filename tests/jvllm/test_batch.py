"""The closed set of step shapes, and how build_batch fills one: fixed sizes whatever the chunks."""
from __future__ import annotations

import numpy as np
import pytest

from jvllm.attention import get_backend
from jvllm.attention.xla import chunk_classes, class_layout
from jvllm.utils import cdiv
from jvllm.worker.batch import ChunkRow, build_batch
from jvllm.worker.step_shapes import ShapeSet, StepShape
from pallas_kernels.ragged_attention import ragged_items

PAGE = 16
MAX_PAGES = 32
XLA_LAYOUT = get_backend("xla").prefill_layout


def chunk(cached: int, new: int) -> ChunkRow:
    """A chunk of `new` tokens after `cached` ones, with the pages it needs (ids from 1)."""
    return ChunkRow([7] * new, cached, list(range(1, cdiv(cached + new, PAGE) + 1)))


def test_the_default_cpu_config_has_fifteen_shapes_known_in_advance():
    shapes = ShapeSet(max_num_seqs=64, max_num_batched_tokens=2048).shapes()
    assert [s.tokens for s in shapes if s.kind == "decode"] == [1, 2, 4, 8, 16, 32, 64]
    assert [(s.tokens, s.seqs) for s in shapes if s.kind == "prefill"] == [
        (16, 16), (32, 32), (64, 64), (128, 64), (256, 64), (512, 64), (1024, 64), (2048, 64)]
    assert all(s.tokens == s.seqs for s in shapes if s.kind == "decode")


def test_limits_that_are_not_powers_of_two_end_the_buckets_and_two_rows_can_be_the_minimum():
    shapes = ShapeSet(max_num_seqs=48, max_num_batched_tokens=3000, min_rows=2)
    assert shapes.decode_sizes == [2, 4, 8, 16, 32, 48]
    assert shapes.prefill_sizes == [16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    assert shapes.decode(1) == StepShape("decode", 2, 2) and shapes.decode(33) == StepShape("decode", 48, 48)
    assert shapes.prefill(2049) == StepShape("prefill", 3000, 48)


def test_a_workload_known_up_front_reaches_the_shapes_that_hold_its_largest_steps():
    shapes = ShapeSet(max_num_seqs=64, max_num_batched_tokens=2048)
    assert shapes.reachable(max_step_tokens=6, max_rows=1) == [StepShape("decode", 1, 1), StepShape("prefill", 16, 16)]
    assert shapes.reachable(max_step_tokens=100, max_rows=5) == [
        StepShape("decode", n, n) for n in (1, 2, 4, 8)] + [StepShape("prefill", n, n) for n in (16, 32, 64)] + [
        StepShape("prefill", 128, 64)]
    assert shapes.reachable(max_step_tokens=10**6, max_rows=10**6) == shapes.shapes()
    assert ShapeSet(48, 3000, min_rows=2).reachable(1, 1) == [StepShape("decode", 2, 2), StepShape("prefill", 16, 16)]


@pytest.mark.parametrize("spans", [[(0, 5)], [(40, 3), (0, 100), (17, 1), (0, 16), (0, 17)], [(0, 128)]])
def test_a_prefill_batch_has_the_shape_of_its_token_bucket_whatever_its_chunks(spans):
    shape = ShapeSet(64, 256).prefill(sum(n for _, n in spans))
    batch = build_batch([chunk(c, n) for c, n in spans], shape, PAGE, MAX_PAGES, XLA_LAYOUT)
    md = batch.metadata
    assert batch.input_ids.shape == md.slot_mapping.shape == (shape.tokens,)
    assert md.q_lens.shape == (shape.seqs,) and md.page_tables.shape == (shape.seqs, MAX_PAGES)
    assert {k: v.shape for k, v in md.layout.items()} == {
        k: v.shape for k, v in build_batch([], shape, PAGE, MAX_PAGES, XLA_LAYOUT).metadata.layout.items()}
    assert list(md.q_lens[:len(spans)]) == [n for _, n in spans]
    assert list(md.kv_lens[:len(spans)]) == [c + n for c, n in spans]
    assert not md.decode


def test_every_chunk_sits_in_the_narrowest_class_that_holds_it():
    q_lens = np.array([5, 100, 16, 17, 1, 64])
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    layout = class_layout(q_lens, starts, np.zeros(6), 256, 64)
    assert chunk_classes(256) == [16, 32, 64, 128, 256]
    placed = {}
    for width in chunk_classes(256):
        index, rows, count = layout[f"index{width}"], layout[f"rows{width}"], int(layout[f"count{width}"])
        for r in range(count):
            tokens = index[r][index[r] < 256]
            placed[int(rows[r])] = (width, list(tokens))
        assert (index[count:] == 256).all()
    for member, n in enumerate(q_lens):
        width, tokens = placed[member]
        assert width == min(w for w in chunk_classes(256) if w >= n)
        assert tokens == list(range(starts[member], starts[member] + n))


def test_a_decode_batch_is_one_token_per_row():
    shape = ShapeSet(8, 64).decode(3)
    batch = build_batch([chunk(5, 1), chunk(20, 1), chunk(0, 1)], shape, PAGE, MAX_PAGES, XLA_LAYOUT)
    md = batch.metadata
    assert md.decode and md.layout == {} and batch.input_ids.shape == (4,)
    assert list(md.query_start[:3]) == [0, 1, 2] and list(md.kv_lens[:3]) == [6, 21, 1]
    with pytest.raises(ValueError, match="one token per chunk"):
        build_batch([chunk(0, 2)], ShapeSet(8, 64).decode(2), PAGE, MAX_PAGES, XLA_LAYOUT)


def test_ragged_work_items_cover_each_sequence_in_blocks():
    item_seq, item_first = ragged_items(np.array([5, 0, 33]), block_q=16, num_tokens=64, num_seqs=4)
    assert len(item_seq) == 64 // 16 + 4
    real = item_first < 64
    assert list(zip(item_seq[real], item_first[real])) == [(0, 0), (2, 0), (2, 16), (2, 32)]
