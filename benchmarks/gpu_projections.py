"""A Llama-3-8B layer's q/k/v and gate/up projections in bf16, as separate products against one product of their
joined weights (what the loader holds: models.llama.fuse_projections), on M = 1, 16, 64 and 256 rows.

Each group runs as the engine's `Linear`s over 8 layers' worth of random weights (together larger than the L2
cache, so each call streams its weights from HBM). Prints microseconds per group, GB/s (weights + activations +
outputs over time), the fraction of the roofline (max(bytes / HBM bandwidth, FLOPs / bf16 peak), data sheet) and
whether XLA's compiled program for the separate products holds a concatenation of their weights (XLA GPU's
DotMerger joins small dots that share an operand by concatenating their weights inside the program, i.e. on every
call; the times say whether that costs a copy). A GPU run takes < 40 s; `--tiny` runs small shapes on CPU only to
prove the script works.

    python -m benchmarks.gpu_projections [--tiny] [--json PATH] [--budget-s 30]
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.gpu_quant_matmul import (batched_call, bench_arguments, device_ceilings, median_seconds,
                                         roofline_timing, timing_columns)
from models.layers import Linear, merge_output_columns

# group -> each projection's (in, out): Llama-3-8B (32 query heads, 8 KV heads of 128; MLP 14336)
GROUPS = {"q/k/v 4096->4096+1024+1024": [(4096, 4096), (4096, 1024), (4096, 1024)],
          "gate/up 4096->2x14336": [(4096, 14336), (4096, 14336)]}
TINY_GROUPS = {"q/k/v 256->256+64+64": [(256, 256), (256, 64), (256, 64)]}
ROWS = (1, 16, 64, 256)
COPIES = 8


def group_layers(shapes: list[tuple[int, int]], copies: int) -> tuple[list[list[Linear]], list[Linear]]:
    """-> (per copy, its separate projections; per copy, one projection of the same weights joined)."""
    apart, joined = [], []
    for i in range(copies):
        made = [Linear(d_in, d_out, bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(10 * i + j))
                for j, (d_in, d_out) in enumerate(shapes)]
        one = nnx.clone(made[0])  # merge_output_columns replaces the first projection's weights, reads the others'
        assert merge_output_columns([one, *made[1:]])
        apart.append(made)
        joined.append(one)
    return apart, joined


def apart_call(groups: list[list[Linear]]):
    """-> (jitted f(states, xs [copies, M, K]) -> each copy's outputs joined [M, sum of outs], the states)."""
    graphdef = nnx.graphdef(groups[0])
    states = [nnx.state(g) for g in groups]

    @jax.jit
    def run(states, xs):
        return [jnp.concatenate([p(xs[i]) for p in nnx.merge(graphdef, s)], axis=1) for i, s in enumerate(states)]

    return run, states


def weights_concatenated(run, states, xs, d_in: int) -> bool:
    """Whether the compiled program concatenates weight-sized arrays (d_in x 64+ elements) inside the call."""
    text = run.lower(states, xs).compile().as_text()
    for line in text.splitlines():
        found = re.search(r"= \w+\[([\d,]+)\]\S* concatenate\(", line)
        if found:
            dims = [int(d) for d in found.group(1).split(",")]
            if d_in in dims and len(dims) == 2 and dims[0] * dims[1] >= 64 * d_in:
                return True
    return False


def bench(args: Any) -> list[dict]:
    """args: bench_arguments' namespace -> the records."""
    device, bandwidth, flops, measured = device_ceilings(args.tiny)
    started, results = time.perf_counter(), []
    copies, iters = (2, 2) if args.tiny else (COPIES, 20)
    print(f"{'group':>28} {'weights':>7} {'M':>4} {'us':>9} {'GB/s':>7} {'roofline':>8}  notes")
    for group, shapes in (TINY_GROUPS if args.tiny else GROUPS).items():
        d_in, d_out = shapes[0][0], sum(out for _, out in shapes)
        apart, joined = group_layers(shapes, copies)
        calls = {"apart": apart_call(apart), "joined": batched_call(joined)}
        group_concatenates = None  # whether XLA's program for the separate products joins their weights
        for rows in ROWS[:2] if args.tiny else ROWS:
            xs = jax.random.normal(jax.random.key(rows), (copies, rows, d_in), jnp.bfloat16)  # [copies, M, K]
            outputs = {}
            for name, (run, states) in calls.items():
                if time.perf_counter() - started > args.budget_s:
                    print(f"time budget of {args.budget_s} s spent: {group} M={rows} {name} and later skipped")
                    return results
                seconds = median_seconds(run, states, xs, iters=iters) / copies
                outputs[name] = run(states, xs)[0].astype(jnp.float32)  # [M, sum of outs]
                notes = []
                concatenated = error = None
                if name == "apart":
                    if group_concatenates is None:  # once a group: XLA's 32 MB merging limit is far from M's effect
                        group_concatenates = weights_concatenated(run, states, xs, d_in)
                    concatenated = group_concatenates
                    notes.append("WEIGHTS CONCATENATED IN THE PROGRAM" if concatenated else "no weight concatenation")
                else:
                    reference = outputs["apart"]
                    error = float(jnp.abs(outputs[name] - reference).max() / jnp.abs(reference).max())
                    notes.append(f"max|joined - apart| / max|apart| = {error:.3g}")
                moved = 2 * d_in * d_out + 2 * rows * (d_in + d_out)  # bf16 weights + activations in and out
                timing = roofline_timing(seconds, moved, 2 * rows * d_in * d_out, bandwidth, flops)
                results.append({"group": group, "weights": name, "rows": rows, **timing,
                                "weights_concatenated": concatenated, "rel_error_vs_apart": error,
                                "device": device.device_kind,
                                "measured_copy_gb_per_s": measured / 1e9})
                print(f"{group:>28} {name:>7} {rows:>4} {timing_columns(timing)}  {'; '.join(notes)}")
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))  # as it goes: a timeout keeps these
    return results


def main() -> None:
    bench(bench_arguments(__doc__, 30.0))


if __name__ == "__main__":
    main()
