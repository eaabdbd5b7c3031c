"""Per-row thresholds found by a bitwise search over the logits' float order: a row's k-th largest value, or the
smallest value with less than a given mass above it, in 32 passes over the row instead of a sort."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

_SIGN = 0x80000000
_MAGNITUDE = 0x7FFFFFFF


def order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order as the floats (NaN aside): [...] -> [...] uint32.

    Non-negative floats keep their bits; negative ones have their magnitude bits flipped, so a larger magnitude
    gives a smaller key; the sign bit is then flipped so that every negative key sorts below every positive one."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    ordered = jnp.where(bits < 0, bits ^ jnp.int32(_MAGNITUDE), bits)  # int32 in float order
    return jax.lax.bitcast_convert_type(ordered, jnp.uint32) ^ jnp.uint32(_SIGN)


def from_order_key(key: jax.Array) -> jax.Array:
    """The float whose order key is `key` (the inverse of order_keys): [...] uint32 -> [...] float32."""
    ordered = jax.lax.bitcast_convert_type(key ^ jnp.uint32(_SIGN), jnp.int32)
    bits = jnp.where(ordered < 0, ordered ^ jnp.int32(_MAGNITUDE), ordered)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def largest_key_where(holds: Callable[[jax.Array], jax.Array], rows: int) -> jax.Array:
    """Per row, the largest key K with holds(K), for a predicate that holds at 0 and, past some key, nowhere
    above it: holds([S] uint32) -> [S] bool; -> [S] uint32. Bits are set from the highest down, each kept where
    the predicate still holds with it set: 32 calls, each one pass over the rows."""
    def step(i: jax.Array, found: jax.Array) -> jax.Array:
        candidate = found | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))  # [S]
        return jnp.where(holds(candidate), candidate, found)

    return jax.lax.fori_loop(0, 32, step, jnp.zeros((rows,), jnp.uint32))


def kth_largest(keys: jax.Array, k: jax.Array) -> jax.Array:
    """keys [S, V] uint32, k [S] int32 in [1, V] -> each row's k-th largest value [S] float32."""
    def holds(candidate: jax.Array) -> jax.Array:  # at least k keys at or above the candidate
        return jnp.sum(keys >= candidate[:, None], axis=-1, dtype=jnp.int32) >= k

    return from_order_key(largest_key_where(holds, keys.shape[0]))


def lowest_with_mass_above_below(keys: jax.Array, probs: jax.Array, mass: jax.Array) -> jax.Array:
    """keys [S, V] uint32, probs [S, V] float32 (>= 0, each row summing to ~1), mass [S] in (0, 1) -> [S] float32:
    the smallest value whose strictly larger values hold less than `mass` of probability (-inf where no value
    has that much above it: the whole row is kept). Every value at or above it is then the smallest set of the
    largest values reaching `mass`, ties kept."""
    def holds(candidate: jax.Array) -> jax.Array:  # the values above the candidate still hold `mass` or more
        return jnp.sum(jnp.where(keys > candidate[:, None], probs, 0.0), axis=-1) >= mass

    found = largest_key_where(holds, keys.shape[0])  # [S]: the largest key with `mass` or more above it
    covered = holds(jnp.zeros_like(found))
    return jnp.where(covered, from_order_key(found + jnp.uint32(1)), -jnp.inf)


__all__ = ["from_order_key", "kth_largest", "largest_key_where", "lowest_with_mass_above_below", "order_keys"]
