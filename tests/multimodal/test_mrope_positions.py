"""M-RoPE positions of any span equal the same span of the whole sequence's, images anywhere (prompt start, end,
back to back), and text-only sequences get their token indices on all three axes."""
from __future__ import annotations

import random

import numpy as np

from jvllm.core.encoder_cache import MultiModalItem
from jvllm.multimodal.positions import mrope_positions


def _items(layout: list[tuple[int, int, int]]) -> list[MultiModalItem]:
    """(offset, rows, cols) per image -> items."""
    return [MultiModalItem("image", index, offset, rows * cols, None, (rows, cols))
            for index, (offset, rows, cols) in enumerate(layout)]


def test_spans_match_the_whole_sequence():
    rng = random.Random(0)
    for _ in range(50):
        layout, cursor = [], rng.randint(0, 3)
        for _ in range(rng.randint(0, 3)):
            rows, cols = rng.randint(1, 4), rng.randint(1, 5)
            layout.append((cursor, rows, cols))
            cursor += rows * cols + rng.randint(0, 3)  # 0: the next image follows at once
        items, total = _items(layout), cursor + 10
        whole = mrope_positions(items, 0, total)
        assert whole.shape == (3, total) and whole.dtype == np.int32
        for _ in range(10):
            start = rng.randint(0, total - 1)
            count = rng.randint(1, total - start)
            np.testing.assert_array_equal(mrope_positions(items, start, count), whole[:, start:start + count])


def test_positions_of_an_image_and_the_text_after_it():
    items = _items([(2, 2, 3)])  # 6 tokens at 2..7, positions advance by max(2, 3) = 3
    positions = mrope_positions(items, 0, 10)
    np.testing.assert_array_equal(positions, [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                                              [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                                              [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(mrope_positions([], 5, 3), [[5, 6, 7]] * 3)
