"""How the `xla` backend stores a bfloat16 KV pool: as the values' uint16 bits, which XLA CPU moves natively (an
8-bit float pool is kept in its own dtype, read as bfloat16).

XLA CPU gathers and scatters a bfloat16 array by converting the whole operand to float32 first (and hoists that
convert out of the decode loop, so each step would convert each layer's whole pool; docs/design/step_shapes.md). On
the same bits seen as uint16 the gather and the scatter touch only the pages they need; the gathered pages are bitcast
back."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.attention import BF16_BITS, EIGHT_BIT_POOLS, value_dtype

BITS = BF16_BITS  # a pool of this dtype holds bfloat16 values


def storage_dtype(dtype: Any) -> jnp.dtype:
    """The pool dtype that stores values of `dtype`."""
    return BITS if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def as_values(x: jax.Array) -> jax.Array:
    """Pages (or any slice of a pool) -> the values they hold (8-bit floats: as bfloat16, which holds them exactly)."""
    if x.dtype in EIGHT_BIT_POOLS:
        return x.astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BITS else x


def as_stored(values: jax.Array, pool_dtype: Any) -> jax.Array:
    """Values (any float dtype) -> what a pool of `pool_dtype` stores for them (rounded to nearest even)."""
    if jnp.dtype(pool_dtype) in EIGHT_BIT_POOLS:
        return values.astype(pool_dtype)
    values = values.astype(value_dtype(pool_dtype))
    return jax.lax.bitcast_convert_type(values, BITS) if jnp.dtype(pool_dtype) == BITS else values
