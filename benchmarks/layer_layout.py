"""Scan over stacked layer weights vs a Python loop over per-layer weights: compile time and decode step time.

SmolLM2-135M shapes (30 layers, d=576, ff=1536), float32, batch 1, the weight matmuls of a decoder layer."""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

D, F, Q, KV, LAYERS = 576, 1536, 576, 192, 30


def layer(x: jax.Array, w: dict) -> jax.Array:
    h = x @ w["q"] + jnp.concatenate([x @ w["k"], x @ w["v"], x @ w["k"]], axis=-1)
    x = x + h @ w["o"]
    return x + (jax.nn.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]


def weights(key: jax.Array, stacked: bool):
    shapes = {"q": (D, Q), "k": (D, KV), "v": (D, KV), "o": (Q, D), "g": (D, F), "u": (D, F), "d": (F, D)}
    make = lambda shape, k: jax.random.normal(k, shape, jnp.float32) * 0.02  # noqa: E731
    keys = jax.random.split(key, len(shapes))
    if stacked:
        return {n: make((LAYERS, *s), k) for (n, s), k in zip(shapes.items(), keys)}
    return [{n: make(s, jax.random.fold_in(k, i)) for (n, s), k in zip(shapes.items(), keys)} for i in range(LAYERS)]


def unrolled(ws: list, x: jax.Array) -> jax.Array:
    for w in ws:
        x = layer(x, w)
    return x


def scanned(ws: dict, x: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda carry, w: (layer(carry, w), None), x, ws)[0]


def measure(fn, ws) -> dict:
    x = jnp.ones((1, D), jnp.float32)
    started = time.perf_counter()
    compiled = jax.jit(fn).lower(ws, x).compile()
    compile_s = time.perf_counter() - started
    compiled(ws, x).block_until_ready()
    steps = 20
    started = time.perf_counter()
    for _ in range(steps):
        x = compiled(ws, x)
    x.block_until_ready()
    return {"compile_s": compile_s, "step_ms": (time.perf_counter() - started) / steps * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    key = jax.random.key(0)
    results = {"per_layer_unrolled": measure(unrolled, weights(key, False)),
               "stacked_scan": measure(scanned, weights(key, True))}
    for name, r in results.items():
        print(f"{name:20s} compile {r['compile_s']:.2f}s  step {r['step_ms']:.2f} ms")
    if args.json:
        json.dump(results, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
