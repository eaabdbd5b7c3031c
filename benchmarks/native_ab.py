"""The native CPU kernels of another commit against this checkout's, alternating in one process.

Two processes minutes apart differ by 20-40% on a shared 2-core VM, more than most kernel changes; one process that
alternates the two builds call by call sees the same machine for both. The other commit's `cpu_kernels/` is built
(with its own build script and `-fno-gnu-unique`, so that the two libraries' function-local statics stay apart; into
the kernels' cache, so each base is built once) and its custom calls registered under `base_*` names; the same
jitted graphs then run with either build's targets: the products of the embedded model's layer shapes (30 layers,
Q4_1 projections in this machine's native layout, random codes) at several row counts, and 30 calls of paged
attention (9 heads, 3 KV heads, head_dim 64, bf16 pages; one pool for all, so its pages stay in the caches) for one
sequence of q queries after `context` keys (with `--seqs`, that many sequences in scattered pages of one pool per
layer, as a decode step of many requests meets them; with `--new-pages fp8_e5m2`, this checkout's calls read 8-bit
pages holding the same values rounded, the base's bf16 ones); with `--bf16-rows`, the products of a float
checkpoint's bf16 copy (30 layers of the model's shapes and the tied head, or of the shapes given, bf16_rows, the
weights on 2 MiB pages where Linux allows, as the engine's) at those row counts. Each line prints both medians, the
median of the rounds' ratios (each round calls both builds, in turn first) with its quartiles, and whether the two
builds give the same bits. Quartiles on both sides of 1 say the run did not tell the builds apart (on the 2-core
VM, 2026-12-06, two identical builds read 0.89-1.11x in single runs). Both builds must take the same custom-call
attributes.

    python -m benchmarks.native_ab --base HEAD   # uncommitted kernel changes against the last commit
    python -m benchmarks.native_ab --base 670729b --rows 1,8,16 --queries 1,16 --context 100,700 --json out.json
    python -m benchmarks.native_ab --base 94a511d --rows "" --queries "" --bf16-rows 1,2,3,4
    python -m benchmarks.native_ab --base HEAD --rows "" --queries 1 --context 140 --seqs 256
    python -m benchmarks.native_ab --base HEAD --rows "" --queries 1 --context 300 --seqs 128 --new-pages fp8_e5m2
    python -m benchmarks.native_ab --base HEAD --rows "" --queries "" --bf16-rows 1 \\
        --bf16-model 2048,5632,512,49152,untied --bf16-layers 8   # a 1.6B model's shapes
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Callable

import numpy as np

from benchmarks.common import command_line, machine_info, write_json

LAYERS = 30
PROJECTIONS = [(576, 576, 2), (192, 576, 2), (576, 1536, 1)]  # (rows, K, per layer): q/o, k/v, down
GATE_UP = (1536, 576)
HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def build_base(base: str, workdir: pathlib.Path) -> pathlib.Path:
    """The cpu_kernels of `base` (a git revision, or a directory holding cpu_kernels/) built with their own build
    script into the kernels' cache (built once per source: this checkout's sources give this checkout's library);
    -> the library."""
    source = pathlib.Path(base)
    if not (source / "cpu_kernels" / "build.py").is_file():
        repo = pathlib.Path(__file__).resolve().parent.parent
        archive = workdir / "base.tar"
        subprocess.run(["git", "-C", str(repo), "archive", "-o", str(archive), base, "cpu_kernels"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(workdir, filter="data")
        source = workdir
    spec = importlib.util.spec_from_file_location("base_kernels_build", source / "cpu_kernels" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    if "-fno-gnu-unique" not in build.FLAGS:  # older sources: their inline statics must stay their own
        build.FLAGS = [*build.FLAGS, "-fno-gnu-unique"]
    return build.built_library(build._compiler())


def register_base(library: pathlib.Path) -> None:
    """The base library's custom calls as base_<name without the jvllm_ prefix>."""
    import jax

    from cpu_kernels.build import TARGETS

    handle = ctypes.CDLL(str(library))
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target("base_" + name.removeprefix("jvllm_"), jax.ffi.pycapsule(getattr(handle, symbol)),
                                    platform="cpu")


def products(prefix: str, rng: np.random.Generator) -> Callable:
    """A jitted (x576 [M, 576], x1536 [M, 1536]) -> per-product sums, over LAYERS layers of the model's shapes."""
    import jax
    import jax.numpy as jnp

    from cpu_kernels import quantized_matmul as qm
    from models.quantized import kernel_row_limits, native_layout

    def blocks(n: int, k: int) -> tuple[jax.Array, str]:
        raw = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
        raw[:, :, 0:4] = np.frombuffer(np.float16([0.01, 0.002]).tobytes(), np.uint8)  # d and m halves
        return native_layout(jnp.asarray(raw.reshape(n, -1)), "q4_1")

    layers = [([blocks(n, k) for n, k, _ in PROJECTIONS], (blocks(*GATE_UP), blocks(*GATE_UP))) for _ in range(LAYERS)]
    int16_max, int16_tile_min = qm.row_path_limits()
    limits = {**kernel_row_limits(), "int16_max_rows": int16_max, "int16_tile_min_rows": int16_tile_min}

    def run(x576: jax.Array, x1536: jax.Array) -> jax.Array:
        sums = []
        for weights, ((gate, fmt), (up, _)) in layers:
            for ((w, f), (_, k, count)) in zip(weights, PROJECTIONS):
                x = x576 if k == 576 else x1536
                sums += [qm._call(prefix + "quantized_matmul", x, (w,), f, None, **limits).sum()] * count
            sums.append(qm._call(prefix + "gated_matmul", x576, (gate, up), fmt, None, **limits).sum())
        return jnp.stack(sums)

    return jax.jit(run)


# A float checkpoint's bf16 copy as the model's one-token steps read it (jvllm.worker.weights), by default the
# embedded model's shapes: hidden, intermediate and K/V widths, vocabulary, whether the head is its own matrix
BF16_MODEL = "576,1536,192,49152,tied"


def bf16_shapes(model: str) -> tuple[list[tuple[int, int, bool]], tuple[int, int, bool]]:
    """From "hidden,intermediate,kv,vocab,tied|untied": (K, N, out_in) of a layer's q/k/v joined, o, gate/up joined
    ([K, N] Linear kernels) and down ([N, K], a narrowing projection); and of the head (a tied head is the
    embedding table [V, hidden], an untied one a Linear kernel [hidden, V])."""
    *dims, head = model.split(",")
    hidden, inner, kv, vocab = (int(v) for v in dims)
    layer = [(hidden, hidden + 2 * kv, False), (hidden, hidden, False), (hidden, 2 * inner, False),
             (inner, hidden, True)]
    return layer, (hidden, vocab, head == "tied")


def bf16_products(prefixes: tuple[str, ...], rng: np.random.Generator, model: str = BF16_MODEL,
                  layers: int = LAYERS) -> dict[str, Callable]:
    """Per custom-call prefix, a jitted x [M, hidden] -> per-product sums over `layers` layers of bf16 weights of the
    model's shapes and its head (bf16_rows). As in a model, the down projection's x is a slice of the gate/up output
    and each layer's x adds the last one's down output (layers that do not wait for each other would let XLA run
    their products side by side). The builds read the same arrays, so neither gets luckier pages."""
    import jax
    import jax.numpy as jnp

    from jvllm.worker.huge_pages import back_with_huge_pages

    layer_shapes, head_shape = bf16_shapes(model)
    inner = layer_shapes[3][0]

    def weights(k: int, n: int, out_in: bool) -> jax.Array:
        bits = rng.integers(0, 1 << 13, (n, k) if out_in else (k, n), dtype=np.uint16) | 0x3800  # [0.03, 0.5)
        signs = rng.integers(0, 2, bits.shape, dtype=np.uint16) << 15
        return jnp.asarray(bits | signs).view(jnp.bfloat16)

    stack = [[weights(*shape) for shape in layer_shapes] for _ in range(layers)]
    head = weights(*head_shape)
    back_with_huge_pages([w for layer in stack for w in layer] + [head])  # as the engine's weights are

    def jitted(prefix: str) -> Callable:
        def product(x: jax.Array, w: jax.Array, out_in: bool) -> jax.Array:
            n = w.shape[0] if out_in else w.shape[1]
            return jax.ffi.ffi_call(prefix + "bf16_rows", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
                x, w, out_in=out_in)

        def run(x: jax.Array, stack: list, head: jax.Array) -> jax.Array:
            sums = []
            for layer in stack:
                outs = [product(x, w, out_in) for w, (_, _, out_in) in zip(layer[:3], layer_shapes[:3])]
                down = product(outs[2][:, :inner] * 1e-2, layer[3], True)
                sums += [o.sum() for o in outs] + [down.sum()]
                x = x + 1e-2 * down  # the next layer waits for this one, as in a model
            return jnp.stack(sums + [product(x, head, head_shape[2]).sum()])

        return functools.partial(jax.jit(run), stack=stack, head=head)

    return {prefix: jitted(prefix) for prefix in prefixes}


def attention(prefix: str, pages: str = "bfloat16") -> Callable:
    """A jitted 30-layer chain of the writing paged attention (queries nudged by each layer's output), layer l over
    pools k_pools[l], v_pools[l] (one pool for all layers where one is given) of `pages` (bfloat16 or fp8_e5m2)."""
    import jax
    import jax.numpy as jnp

    def layers(q, k, k_pools, v_pools, query_start, q_lens, kv_lens, page_tables, slots):
        stored = k.astype(jnp.float8_e5m2) if pages == "fp8_e5m2" else k.astype(jnp.bfloat16).view(jnp.uint16)
        k_pools, v_pools = list(k_pools), list(v_pools)
        outs = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k_pools[0].shape, k_pools[0].dtype),
                jax.ShapeDtypeStruct(v_pools[0].shape, v_pools[0].dtype))
        call = jax.ffi.ffi_call(prefix + "paged_attention_write", outs, input_output_aliases={5: 1, 6: 2})
        for layer in range(LAYERS):
            i = layer % len(k_pools)
            out, k_pools[i], v_pools[i] = call(q, k, k, stored, stored, k_pools[i], v_pools[i], query_start, q_lens,
                                               kv_lens, page_tables, slots, scale=np.float32(HEAD_DIM ** -0.5),
                                               sliding_window=np.int64(0), soft_cap=np.float32(0.0),
                                               bf16_tiles=np.int64(1), direct_queries=np.int64(16))
            q = q + out * 1e-3
        return q, k_pools, v_pools

    return jax.jit(layers, donate_argnums=(2, 3))


def attention_inputs(rng: np.random.Generator, queries: int, context: int, seqs: int = 1,
                     pages_dtype: str = "bfloat16") -> tuple:
    """`seqs` sequences of `context` keys each, their last `queries` tokens this step's; one sequence: in pages 1..
    of one random bf16 pool; several: in scattered pages of one pool per layer (a decode step of many requests reads
    every layer's keys from memory, not from the caches). `pages_dtype` fp8_e5m2: the same values rounded to 8 bits."""
    import jax
    import jax.numpy as jnp

    pages = -(-context // PAGE)
    num_pages = seqs * pages + 2
    pool = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
    def bits() -> jax.Array:  # bf16 values in [0.5, 4)
        values = jnp.asarray(rng.integers(0, 1 << 14, pool).astype(np.uint16) | 0x3000)
        return values.view(jnp.bfloat16).astype(jnp.float8_e5m2) if pages_dtype == "fp8_e5m2" else values

    tables = (np.arange(1, pages + 1)[None] if seqs == 1 else
              rng.permutation(np.arange(1, num_pages))[:seqs * pages].reshape(seqs, pages)).astype(np.int32)
    positions = np.arange(context - queries, context)
    slots = (tables[:, positions // PAGE] * PAGE + positions % PAGE).reshape(-1)
    tokens = seqs * queries
    pools = 1 if seqs == 1 else LAYERS
    return (jnp.asarray(rng.standard_normal((tokens, HEADS, HEAD_DIM)), jnp.float32),
            jnp.asarray(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)), jnp.float32),
            [bits() for _ in range(pools)], [bits() for _ in range(pools)],
            jnp.arange(0, tokens, queries, dtype=jnp.int32), jnp.full(seqs, queries, jnp.int32),
            jnp.full(seqs, context, jnp.int32), jnp.asarray(tables), jnp.asarray(slots, jnp.int32))


def alternate(calls: dict[str, Callable[[], object]], reps: int) -> dict:
    """Runs each call `reps` times, alternating, the order reversed every other round -> {"base_ms", "new_ms" (the
    medians), "new_over_base" (the median of the rounds' new / base: each round's two calls see the machine alike),
    "ratio_quartiles", "same_bits"}."""
    import jax

    first = {name: [np.asarray(x) for x in jax.tree.leaves(call())] for name, call in calls.items()}
    times = {name: [] for name in calls}
    names = list(calls)
    for round_ in range(reps):
        for name in names if round_ % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            jax.block_until_ready(calls[name]())
            times[name].append(time.perf_counter() - started)
    base, new = (statistics.median(times[name]) * 1e3 for name in ("base", "new"))
    ratios = [n / b for b, n in zip(times["base"], times["new"])]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    same = all(np.array_equal(a, b) for a, b in zip(first["base"], first["new"]))
    return {"base_ms": base, "new_ms": new, "new_over_base": statistics.median(ratios),
            "ratio_quartiles": [quartiles[0], quartiles[2]], "same_bits": same}


def _quartiles(row: dict) -> str:
    low, high = row["ratio_quartiles"]
    return f"rounds' quartiles {low:.3f}-{high:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True,
                        help="the git revision to compare against, or a directory holding another cpu_kernels/")
    parser.add_argument("--rows", default="1,8,16", help="row counts of the products (empty: none)")
    parser.add_argument("--bf16-rows", default="", help="row counts of the bf16 products (bf16_rows; empty: none)")
    parser.add_argument("--bf16-model", default=BF16_MODEL,
                        help="their shapes: hidden,intermediate,kv,vocab,tied|untied (default: the embedded model's)")
    parser.add_argument("--bf16-layers", type=int, default=LAYERS, help="their layers (each its own weights)")
    parser.add_argument("--queries", default="1,16", help="queries of the attention's sequence (empty: none)")
    parser.add_argument("--context", default="100,700", help="its keys, after this step's")
    parser.add_argument("--seqs", type=int, default=1,
                        help="sequences of the attention's step (several: one pool per layer, scattered pages)")
    parser.add_argument("--new-pages", default="bfloat16", choices=["bfloat16", "fp8_e5m2"],
                        help="the KV pages this checkout's attention calls read (the base's: bfloat16)")
    parser.add_argument("--reps", type=int, default=30, help="calls of each build per case")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    args = parser.parse_args(argv)
    ints = lambda text: [int(v) for v in text.split(",") if v]

    import jax.numpy as jnp

    from cpu_kernels.build import load

    load()
    with tempfile.TemporaryDirectory() as workdir:
        print(f"building {args.base}'s cpu_kernels ...", flush=True)
        register_base(build_base(args.base, pathlib.Path(workdir)))
    rng = np.random.default_rng(0)
    results = {"command": command_line("benchmarks.native_ab", argv), "machine": machine_info(), "base": args.base,
               "new_pages": args.new_pages,
               "products": {}, "bf16_products": {}, "attention": {}}
    if ints(args.rows):
        fns = {name: products(prefix, np.random.default_rng(1)) for name, prefix in (("base", "base_"),
                                                                                     ("new", "jvllm_"))}
    for m in ints(args.rows):
        x576, x1536 = (jnp.asarray(rng.standard_normal((m, k)), jnp.float32) for k in (576, 1536))
        row = alternate({name: (lambda f=f: f(x576, x1536)) for name, f in fns.items()}, args.reps)
        results["products"][m] = row
        print(f"products, {m:2d} rows: base {row['base_ms']:.2f} ms, new {row['new_ms']:.2f} ms -> "
              f"{row['new_over_base']:.3f}x ({_quartiles(row)}); same bits: {row['same_bits']}", flush=True)
    if ints(args.bf16_rows):
        by_prefix = bf16_products(("base_", "jvllm_"), np.random.default_rng(2), args.bf16_model, args.bf16_layers)
        fns = {"base": by_prefix["base_"], "new": by_prefix["jvllm_"]}
    for m in ints(args.bf16_rows):
        x = jnp.asarray(rng.standard_normal((m, bf16_shapes(args.bf16_model)[1][0])), jnp.float32)
        row = alternate({name: (lambda f=f: f(x)) for name, f in fns.items()}, args.reps)
        results["bf16_products"][m] = row
        print(f"bf16 products, {m} rows: base {row['base_ms']:.2f} ms, new {row['new_ms']:.2f} ms -> "
              f"{row['new_over_base']:.3f}x ({_quartiles(row)}); same bits: {row['same_bits']}", flush=True)
    pages = {"base": "bfloat16", "new": args.new_pages}
    runs = {name: attention(prefix, pages[name]) for name, prefix in (("base", "base_"), ("new", "jvllm_"))}
    for q in ints(args.queries):
        for context in ints(args.context):
            if q > context:  # a step's queries are the last of its keys
                print(f"attention, {q} queries after {context} keys: skipped (more queries than keys)", flush=True)
                continue
            inputs = {name: list(attention_inputs(np.random.default_rng(context + q), q, context, args.seqs,
                                                  pages[name])) for name in runs}

            def step(name: str):
                out, inputs[name][2], inputs[name][3] = runs[name](*inputs[name])  # the pools come back donated
                return out

            row = alternate({name: (lambda name=name: step(name)) for name in runs}, args.reps)
            results["attention"][f"{args.seqs}x{q}x{context}" if args.seqs > 1 else f"{q}x{context}"] = row
            print(f"attention, {args.seqs} x {q:2d} queries after {context} keys: base {row['base_ms']:.2f} ms, new "
                  f"{row['new_ms']:.2f} ms -> {row['new_over_base']:.3f}x ({_quartiles(row)}); "
                  f"same bits: {row['same_bits']}", flush=True)
    write_json(args.json_path, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
