"""Weight-only int8 / fp8 projections against bf16 on Llama-3-8B shapes: time per call and weight bandwidth.

Each variant is the engine's own `Linear` (bf16 kernel [in, out]; per-channel int8 or fp8 codes [out, in] with
float32 scales, models.channel_quant) on bf16 activations of M rows. Prints microseconds per projection, achieved
GB/s (weights + activations + output bytes / time) and the fraction of the roofline: max(bytes / HBM bandwidth,
FLOPs / bf16 peak) from the device's data sheet, next to a device copy's bandwidth measured in the same run. It also
says whether XLA fused the codes' convert into the GEMM (no [out, in] float weight in the compiled entry), and on a
Hopper GPU times jax's Mosaic GPU int8 x bf16 kernel (hopper_mixed_type_matmul_mgpu) where M allows.
A GPU run takes < 60 s; `--tiny` runs small shapes on CPU only to prove the script works.

    python -m benchmarks.gpu_quant_matmul [--tiny] [--json PATH] [--budget-s 50]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.channel_quant import quantize_channels
from models.layers import Linear

SHAPES = {"gate/up 4096->14336": (4096, 14336), "down 14336->4096": (14336, 4096)}  # Llama-3-8B (in, out)
TINY_SHAPES = {"tiny 256->512": (256, 512)}
ROWS = (1, 16, 64, 256)
VARIANTS = ("bf16", "int8_channel", "fp8_channel")
# device kind substring -> (HBM bytes/s, dense bf16 FLOP/s) from the data sheets; the first match wins
DATA_SHEETS = (("H200", 4.8e12, 989e12), ("H100 PCIe", 2.0e12, 756e12), ("H100", 3.35e12, 989e12))


def data_sheet(kind: str) -> tuple[float | None, float | None]:
    for name, bandwidth, flops in DATA_SHEETS:
        if name in kind:
            return bandwidth, flops
    return None, None


def layers(variant: str, d_in: int, d_out: int, copies: int) -> list[Linear]:
    """`copies` projections with different random weights (together larger than the L2 cache, so each call
    streams its weights from HBM)."""
    made = []
    for i in range(copies):
        layer = Linear(d_in, d_out, bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(i))
        if variant != "bf16":
            codes, scale = quantize_channels(layer.kernel[...], variant, transposed=True)  # [out, in], [out]
            layer.set_quantized(codes, variant, scale)
        made.append(layer)
    return made


def batched_call(projections: list[Linear]) -> tuple[Callable, list[Any]]:
    """-> (jitted f(states, xs [copies, M, K]) -> each copy's y [M, N], the states): one executable runs every
    copy back to back, so host dispatch is paid once per `copies` projections."""
    graphdef = nnx.graphdef(projections[0])
    states = [nnx.state(p) for p in projections]

    @jax.jit
    def run(states: list[Any], xs: jax.Array) -> list[jax.Array]:
        return [nnx.merge(graphdef, s)(xs[i]) for i, s in enumerate(states)]

    return run, states


def mosaic_int8_dot(x: jax.Array, codes: jax.Array, scale: jax.Array, tile_m: int = 64, tile_k: int = 128) -> jax.Array:
    """x [M, K] bf16 with int8 codes [N, K] and scales [N] -> [M, N] bf16 through jax's Hopper mixed-type Mosaic GPU
    kernel: the codes are its register-fed int8 LHS (converted to bf16 in registers before each wgmma), x^T its
    bf16 RHS in shared memory; the scales multiply the result. Needs N % (2 tile_m), M % 64 and K % tile_k == 0."""
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    config = mixed.TuningConfig(tile_m=tile_m, tile_n=64, tile_k=tile_k, max_concurrent_steps=4, epi_tile_m=64,
                                epi_tile_n=64, wg_dimension=mixed.MatmulDimension.M)
    y_t = mixed.mixed_matmul_kernel(codes, x.T, out_dtype=jnp.bfloat16, config=config)  # [N, M]
    return (y_t.T.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def median_seconds(fn: Callable, *args: Any, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compiles
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - started) / iters)
    return statistics.median(samples)


def convert_fused(fn: Callable, *args: Any, d_in: int, d_out: int) -> bool:
    """Whether the compiled program's entry computation holds no float [out, in] / [in, out] array: the codes'
    convert was fused into the GEMM rather than written out as a dequantized weight."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    dims = f"({d_out},{d_in}|{d_in},{d_out})"
    return not re.search(rf"= (bf16|f16|f32)\[{dims}\]", entry)


def roofline_timing(seconds: float, moved: int, flop: int, bandwidth: float | None, flops: float | None) -> dict:
    """A call's time against its roofline, max(bytes moved / HBM bandwidth, FLOPs / peak) (None without a data
    sheet)."""
    bound = None if bandwidth is None else max(moved / bandwidth, flop / flops)
    return {"us": seconds * 1e6, "gb_per_s": moved / seconds / 1e9, "bytes": moved,
            "roofline_us": None if bound is None else bound * 1e6,
            "roofline_fraction": None if bound is None else bound / seconds}


def timing_columns(timing: dict) -> str:
    """us, GB/s and roofline fraction, as the benchmarks' tables print them."""
    fraction = "-" if timing["roofline_fraction"] is None else f"{timing['roofline_fraction']:.0%}"
    return f"{timing['us']:>9.1f} {timing['gb_per_s']:>7.0f} {fraction:>8}"


def copy_bandwidth(tiny: bool) -> float:
    """Bytes read + written per second by a large elementwise add (this run's own HBM figure)."""
    x = jnp.ones(((8 << 20) if tiny else (1 << 30)) // 2, jnp.bfloat16)
    return 2 * x.nbytes / median_seconds(jax.jit(lambda a: a + 1), x, iters=3 if tiny else 20)


def device_ceilings(tiny: bool) -> tuple[Any, float | None, float | None, float]:
    """-> (the device, its data sheet's HBM bytes/s and bf16 FLOP/s, this run's copy bandwidth), printed."""
    device = jax.devices()[0]
    bandwidth, flops = data_sheet(device.device_kind)
    measured = copy_bandwidth(tiny)
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}; data sheet "
          f"{'-' if bandwidth is None else f'{bandwidth / 1e12:.2f} TB/s'}, measured copy {measured / 1e9:.0f} GB/s")
    return device, bandwidth, flops, measured


def bench(args: argparse.Namespace) -> list[dict]:
    device, bandwidth, flops, measured = device_ceilings(args.tiny)
    started, results = time.perf_counter(), []
    copies, iters = (2, 2) if args.tiny else (8, 20)
    hopper = jax.default_backend() == "gpu" and any(name in device.device_kind for name in ("H100", "H200", "H800"))
    print(f"{'shape':>22} {'variant':>14} {'M':>4} {'us':>9} {'GB/s':>7} {'roofline':>8}  notes")
    for shape, (d_in, d_out) in (TINY_SHAPES if args.tiny else SHAPES).items():
        built = {v: layers(v, d_in, d_out, copies) for v in VARIANTS}
        calls = {v: batched_call(built[v]) for v in VARIANTS}
        for rows in ROWS if not args.tiny else ROWS[:2]:
            xs = jax.random.normal(jax.random.key(rows), (copies, rows, d_in), jnp.bfloat16)  # [copies, M, K]
            reference = None
            candidates = list(VARIANTS)
            if hopper and rows % 64 == 0 and d_out % 128 == 0:
                candidates.append("mosaic_int8")
            for variant in candidates:
                if time.perf_counter() - started > args.budget_s:
                    print(f"time budget of {args.budget_s} s spent: {shape} M={rows} {variant} and later skipped")
                    return results
                if variant == "mosaic_int8":
                    state = [(w.kernel[...], w.scale[...]) for w in built["int8_channel"]]
                    run = jax.jit(lambda ws, xs: [mosaic_int8_dot(xs[i], *w) for i, w in enumerate(ws)])
                else:
                    run, state = calls[variant]
                weight_bytes = d_in * d_out * 2 if variant == "bf16" else d_in * d_out + 4 * d_out  # + scales
                notes, error, fused = [], None, None
                try:
                    seconds = median_seconds(run, state, xs, iters=iters) / copies
                    y = run(state, xs)[0].astype(jnp.float32)  # [M, N]
                except Exception as failure:  # a kernel that does not build here is reported, not fatal
                    print(f"{shape:>22} {variant:>14} {rows:>4}  failed: {type(failure).__name__}: {failure}"[:300])
                    continue
                if reference is None:
                    reference = y
                else:
                    error = float(jnp.abs(y - reference).max() / jnp.abs(reference).max())
                    notes.append(f"max|y - y_bf16| / max|y_bf16| = {error:.3g}")
                if variant in ("int8_channel", "fp8_channel") and rows in (1, 16):
                    layer = built[variant][0]
                    fused = convert_fused(lambda s, x: nnx.merge(nnx.graphdef(layer), s)(x), nnx.state(layer),
                                          xs[0], d_in=d_in, d_out=d_out)
                    notes.append("convert fused into the GEMM" if fused else "DEQUANTIZED WEIGHT MATERIALIZED")
                moved = weight_bytes + 2 * rows * (d_in + d_out)  # + bf16 activations in and out
                timing = roofline_timing(seconds, moved, 2 * rows * d_in * d_out, bandwidth, flops)
                results.append({"shape": shape, "d_in": d_in, "d_out": d_out, "variant": variant, "rows": rows,
                                **timing, "rel_error_vs_bf16": error, "convert_fused": fused,
                                "device": device.device_kind, "measured_copy_gb_per_s": measured / 1e9})
                print(f"{shape:>22} {variant:>14} {rows:>4} {timing_columns(timing)}  {'; '.join(notes)}")
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))  # as it goes: a timeout keeps these
    return results


def bench_arguments(doc: str, budget_s: float) -> argparse.Namespace:
    """The command line of a projection benchmark: --tiny, --json, --budget-s."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shapes, 2 copies: a CPU smoke run")
    parser.add_argument("--json", default=None, help="write the records here (rewritten after each one)")
    parser.add_argument("--budget-s", type=float, default=budget_s, help="start no measurement after this many seconds")
    return parser.parse_args()


def main() -> None:
    bench(bench_arguments(__doc__, 50.0))


if __name__ == "__main__":
    main()
