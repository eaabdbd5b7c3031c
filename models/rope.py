"""Rotary position embeddings (HF "rotate half" layout), with linear, llama3, yarn, dynamic-NTK and LongRoPE scaling."""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """[head_dim // 2] float32 rotation frequencies, rescaled as the config asks."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv_freq.astype(np.float32)
    if scaling["rope_type"] == "dynamic":
        # NTK scaling changes the base only for sequences past max_position_embeddings, which max_model_len never
        # exceeds: within it, the frequencies are the default ones (as transformers computes them)
        return inv_freq.astype(np.float32)
    if scaling["rope_type"] == "longrope":  # the short factors: max_model_len stays within the original context
        return _longrope_frequencies(head_dim, theta, scaling["short_factor"])
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(head_dim, theta, factor, scaling).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    blend = (original_len / wavelength - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = np.where(wavelength > original_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelength <= original_len / low) & (wavelength >= original_len / high)
    return np.where(in_band, blended, scaled).astype(np.float32)


def _yarn_frequencies(head_dim: int, theta: float, factor: float, scaling: dict[str, Any]) -> np.ndarray:
    """YaRN: frequencies that rotate fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those rotating more than `beta_fast` times are kept, with a linear ramp between."""
    original_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)  # 0: keep, 1: scale
    pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)


def _longrope_frequencies(head_dim: int, theta: float, factors: list[float]) -> np.ndarray:
    """LongRoPE: each frequency divided by its own factor (one per pair of dims)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
    return (1.0 / (np.asarray(factors, np.float32) * theta ** exponents)).astype(np.float32)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's and LongRoPE's attention temperature, 1 otherwise."""
    if not scaling or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        factor = float(scaling["factor"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def rotary_tables(positions: jnp.ndarray, inv_freq: np.ndarray,
                  scale: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions [T] int32 -> (cos, sin) each [T, head_dim] float32, multiplied by `scale`."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, hd]
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return scale * jnp.cos(angles), scale * jnp.sin(angles)


def mrope_rotary_tables(positions: jnp.ndarray, inv_freq: np.ndarray,
                        section: tuple[int, ...]) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Multimodal RoPE (Qwen2-VL): positions [3, T] int32 (temporal, height, width) -> (cos, sin) [T, hd] float32.
    The first section[0] frequencies turn with the temporal positions, the next section[1] with the heights, the
    last section[2] with the widths; text tokens carry three equal positions, which gives plain RoPE."""
    axis = np.repeat(np.arange(len(section)), section)  # [hd/2]: the position row driving each frequency
    angles = positions.astype(jnp.float32)[axis].T * jnp.asarray(inv_freq)[None, :]  # [T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, hd]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [T, heads, hd] rotated by per-token tables [T, rd]; math in float32, result in x.dtype. With rd < hd
    (partial rotary), only the first rd dims of each head rotate and the rest pass through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    lo, hi = x32[..., :half], x32[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    # each half from its own products (no negated copy of x concatenated first): the same arithmetic, and XLA's
    # CPU fusion of it runs ~1.3x faster
    out = jnp.concatenate([lo * cos[..., :half] - hi * sin[..., :half], hi * cos[..., half:] + lo * sin[..., half:]],
                          axis=-1)
    return out.astype(x.dtype)
