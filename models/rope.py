"""Rotary position embeddings (HF "rotate half" layout), with linear and llama3 frequency scaling."""
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
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    blend = (original_len / wavelength - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = np.where(wavelength > original_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelength <= original_len / low) & (wavelength >= original_len / high)
    return np.where(in_band, blended, scaled).astype(np.float32)


def rotary_tables(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions [T] int32 -> (cos, sin) each [T, head_dim] float32."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, hd]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [T, heads, hd] rotated by per-token tables [T, hd]; math in float32, result in x.dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated_half = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, None, :] + rotated_half * sin[:, None, :]
    return out.astype(x.dtype)
