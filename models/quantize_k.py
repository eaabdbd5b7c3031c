"""Float weights -> GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) in numpy, for test files and dummy quantized models:
a plain min/max quantizer per sub-block (llama.cpp's quantize searches the scales more carefully; the blocks are the
same format and read the same way)."""
from __future__ import annotations

import numpy as np


def _halves(values: np.ndarray) -> np.ndarray:
    """[...] float -> [..., 2] uint8 little-endian IEEE halves."""
    return values.astype("<f2").view(np.uint8).reshape(*values.shape, 2)


def _pack_scale_min(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [..., 8] -> the 12 packed bytes of a Q4_K / Q5_K block [..., 12]."""
    sc, mn = scales.astype(np.uint8), mins.astype(np.uint8)
    first = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    second = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    third = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=-1)


def _quantize_min_max(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """w [R, B, 8, 32] -> codes [R, B, 8, 32] in 0..levels, d, dmin [R, B] float16 and 6-bit sc, mn [R, B, 8] with
    w ~ d * sc * code - dmin * mn."""
    low = np.minimum(w.min(-1), 0.0)  # [R, B, 8]
    step = (w.max(-1) - low) / levels
    d = (step.max(-1) / 63).astype(np.float16)  # [R, B]
    dmin = (-low.min(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    scale = (d32 * sc)[..., None]
    shifted = w + (dmin32 * mn)[..., None]
    codes = np.clip(np.rint(np.divide(shifted, scale, out=np.zeros_like(w), where=scale > 0)), 0, levels)
    return codes.astype(np.uint8), d, dmin, sc, mn


def quantize_k(weights: np.ndarray, fmt: str) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> its blocks [N, row bytes] uint8 in `fmt` ('q4_k', 'q5_k', 'q6_k')."""
    n, k = weights.shape
    if k % 256:
        raise ValueError(f"{fmt}: rows of {k} weights are not whole blocks of 256")
    w = np.asarray(weights, np.float32).reshape(n, k // 256, 8, 32)  # [R, B, sub-block, weight]
    if fmt == "q6_k":
        return _quantize_q6_k(w).reshape(n, -1)
    codes, d, dmin, sc, mn = _quantize_min_max(w, 31 if fmt == "q5_k" else 15)
    pairs = codes.reshape(n, k // 256, 4, 2, 32)  # sub-blocks 2i, 2i + 1 share 32 bytes
    qs = ((pairs[..., 0, :] & 15) | ((pairs[..., 1, :] & 15) << 4)).reshape(n, k // 256, 128)
    parts = [_halves(d), _halves(dmin), _pack_scale_min(sc, mn)]
    if fmt == "q5_k":  # bit s of qh[l]: the fifth bit of weight l of sub-block s
        fifth = (codes >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]  # [R, B, 8, 32]
        parts.append(np.bitwise_or.reduce(fifth, axis=-2))
    elif fmt != "q4_k":
        raise ValueError(f"unknown K-quant format {fmt!r}")
    return np.concatenate([*parts, qs], axis=-1).reshape(n, -1)


def _quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w [R, B, 8, 32] -> Q6_K blocks [R, B, 210]: 16 groups of 16 with int8 scales, codes q - 32 in -32..31."""
    r, b = w.shape[:2]
    groups = w.reshape(r, b, 16, 16)
    step = np.abs(groups).max(-1) / 32  # [R, B, 16]
    d = (step.max(-1) / 127).astype(np.float16)  # [R, B]
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), -128, 127)
    scale = (d32 * sc)[..., None]
    q = np.clip(np.rint(np.divide(groups, scale, out=np.zeros_like(groups), where=scale > 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(r, b, 2, 4, 32)  # [.., 128-weight half h, p, l]: sub-block 4h + p
    ql = (q[:, :, :, 0:2] & 15) | ((q[:, :, :, 2:4] & 15) << 4)  # [.., h, part p & 1, l]: p >= 2 -> high nibble
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=-2)  # [.., h, l]
    return np.concatenate([ql.reshape(r, b, 128), qh.reshape(r, b, 64), sc.astype(np.int8).view(np.uint8),
                           _halves(d)], axis=-1)
