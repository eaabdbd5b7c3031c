"""Multimodal RoPE positions (Qwen2-VL): a token's (temporal, height, width) position triple, from the prompt's image
items alone, so any chunk of any request (prefill, decode, recomputation after preemption) gets its positions without
per-request state."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jvllm.core.encoder_cache import MultiModalItem


def mrope_positions(items: Sequence[MultiModalItem], start: int, count: int) -> np.ndarray:
    """-> [3, count] int32 positions of tokens [start, start + count) of a sequence whose prompt holds `items`
    (each with its token grid, in prompt order).

    A text token's three positions are its index plus the shift of the images before it; an image of rows x cols
    tokens starting at (shifted) position p puts its token (r, c) at (p, p + r, p + c) and advances the positions by
    max(rows, cols), not rows * cols, so every later token is shifted by max(rows, cols) - rows * cols."""
    index = np.arange(start, start + count, dtype=np.int64)  # [count]
    positions = np.repeat(index[None], 3, axis=0)  # [3, count]
    shift = 0  # of the images so far
    for item in items:
        rows, cols = item.grid
        base = item.offset + shift
        inside = (index >= item.offset) & (index < item.end)
        local = index[inside] - item.offset
        positions[:, inside] = np.stack([np.full_like(local, base), base + local // cols, base + local % cols])
        item_shift = max(rows, cols) - rows * cols
        positions[:, index >= item.end] += item_shift
        shift += item_shift
    return positions.astype(np.int32)
