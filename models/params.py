"""Parameter initialization shared by the model families: random weights, or their shapes only for loading."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    """Random N(0, 0.02) weights, or with `rngs=None` only their shape, for weights loaded afterwards
    (by the model loader)."""
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(shape, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02).astype(dtype))


def value_or_none(param: nnx.Param | None) -> jax.Array | None:
    """The array a Param holds, or None for an absent one (e.g. the scale of a format that has none)."""
    return None if param is None else param[...]
