"""Kernel benchmark: Pallas decode / prefill attention vs the jnp reference and jax's shipped paged_attention.

Decode and prefill time jvllm's kernels on a GPU: the Triton ones (`pallas`) and the Mosaic GPU ones (`mosaic`, jax
>= 0.11; for prefill both the one-warpgroup kernel and the warp-specialized one, `mosaic_warp_specialized`).

Decode prints achieved GB/s (KV bytes read / time), prefill TFLOP/s, each next to the device ceilings measured
in the same run (a large device copy for bandwidth, a large bf16 matmul for FLOP/s); prefill also times jax's
Mosaic GPU flash attention (dense causal K/V, Hopper) at the same tokens, the yardstick for the ragged kernel;
kv_write compares the XLA scatter with the Pallas store kernel for writing a step's K/V into a donated pool.
`--sweep` times block sizes, splits, warps and stages at the SWEEP_CASES shapes. The JSON is rewritten after every
case, so a run cut short by its time limit keeps what it measured; `--budget-s` starts no case after that many
seconds. Meant for a GPU; `--quick` runs tiny shapes in interpret mode on CPU only to prove the script works.

    python benchmarks/kernels.py [--quick] [--full] [--sweep] [--budget-s S] [--json PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.jax_attention_kernels import mosaic_flash_attention, shipped_paged_attention
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.kv_write import write_kv
from pallas_kernels.mosaic_common import mosaic_gpu_available
from pallas_kernels.mosaic_decode import mosaic_decode_attention
from pallas_kernels.mosaic_ragged import BLOCK_Q as MOSAIC_BLOCK_Q, mosaic_ragged_paged_attention
from pallas_kernels.mosaic_ragged_ws import BLOCK_Q as MOSAIC_WS_BLOCK_Q, mosaic_ragged_ws_attention
from pallas_kernels.ragged_attention import ragged_block_q, ragged_items, ragged_paged_attention
from pallas_kernels.reference import decode_attention_reference, ragged_attention_reference

KV_HEADS = 8  # Llama-3-8B-like: 8 KV heads; query heads = KV_HEADS * gqa


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    head_dim: int
    gqa: int
    page_size: int = 16
    kv_heads: int = KV_HEADS


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    seqs: int
    tokens_per_seq: int
    head_dim: int
    gqa: int
    page_size: int = 16
    kv_heads: int = KV_HEADS


def time_fn(fn: Callable, *args, warmup: int, iters: int) -> float:
    """Median seconds of `iters` runs after `warmup` runs (the first also compiles)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_ceilings(quick: bool, warmup: int, iters: int) -> dict:
    """Copy bandwidth (bytes read + written / s) and bf16 matmul rate (FLOP/s) of this device, same run."""
    copy_bytes = (8 << 20) if quick else (2 << 30)
    # each reads and writes every byte once; the fastest counts (XLA's loop over 2-byte values can run well under a
    # plain device copy: 2.77 against ~4.3 TB/s on an H200)
    probes = {"bf16_plus_one": (lambda a: a + 1, jnp.ones(copy_bytes // 2, jnp.bfloat16)),
              "u32_plus_one": (lambda a: a + 1, jnp.ones(copy_bytes // 4, jnp.uint32)),
              "u32_copy": (lambda a: a.copy(), jnp.ones(copy_bytes // 4, jnp.uint32))}
    copy_rates = {name: 2 * copy_bytes / time_fn(jax.jit(fn), x, warmup=warmup, iters=iters)
                  for name, (fn, x) in probes.items()}
    n = 256 if quick else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)  # not constant: that can run faster
    matmul = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32))
    mm_seconds = time_fn(matmul, a, a, warmup=warmup, iters=iters)
    return {"copy_bytes_per_s": max(copy_rates.values()), "copy_probes_bytes_per_s": copy_rates,
            "bf16_matmul_flops": 2 * n ** 3 / mm_seconds}


def _pool(rng: np.random.Generator, seqs: int, context: int, page_size: int, kv_heads: int, head_dim: int):
    """A page pool holding `seqs` sequences of `context` tokens in scrambled pages (page 0 reserved)."""
    pages_per_seq = -(-context // page_size)
    num_pages = 1 + seqs * pages_per_seq
    tables = (1 + rng.permutation(seqs * pages_per_seq)).reshape(seqs, pages_per_seq).astype(np.int32)
    key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages = jax.random.normal(key_k, shape, jnp.bfloat16)
    v_pages = jax.random.normal(key_v, shape, jnp.bfloat16)
    return k_pages, v_pages, jnp.asarray(tables)


def _max_error(fn: Callable, args: tuple, expected: jax.Array | None) -> float | None:
    """Largest |fn(args) - expected| (a sanity check that the timed kernel computes the right thing)."""
    if expected is None:
        return None
    try:
        return float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - expected.astype(jnp.float32))))
    except Exception:
        return None


def _reference_output(fn: Callable, args: tuple) -> jax.Array | None:
    try:
        return jax.block_until_ready(fn(*args))
    except Exception:  # the dense reference may not fit at the largest shapes
        return None


def _try_time(fn: Callable, args: tuple, warmup: int, iters: int) -> float | str:
    try:
        return time_fn(fn, *args, warmup=warmup, iters=iters)
    except Exception as err:  # e.g. out of memory for the dense reference at the largest shapes
        return f"error: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"


def bench_decode(case: DecodeCase, ceilings: dict, args: argparse.Namespace, interpret: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    k_pages, v_pages, tables = _pool(rng, case.batch, case.context, case.page_size, case.kv_heads, case.head_dim)
    heads = case.kv_heads * case.gqa
    q = jax.random.normal(jax.random.key(1), (case.batch, heads, case.head_dim), jnp.bfloat16)
    lengths = jnp.full((case.batch,), case.context, jnp.int32)
    scale = case.head_dim ** -0.5
    kv_bytes = 2 * case.batch * case.context * case.kv_heads * case.head_dim * 2  # K and V, bf16

    impls: dict[str, tuple[Callable, tuple]] = {}
    configs = [{}]
    if args.sweep and case in SWEEP_DECODE:
        configs += [dict(pages_per_block=p, num_splits=s, num_warps=w, num_stages=st) for p in (4, 8)
                    for s in (1, 4, 16) for w in (4, 8) for st in (1, 2)]
    for config in configs:
        name = "pallas" + (f"[{','.join(f'{k}={v}' for k, v in config.items())}]" if config else "")
        fn = jax.jit(functools.partial(decode_attention, scale=scale, interpret=interpret, **config))
        impls[name] = (fn, (q, k_pages, v_pages, tables, lengths))
    if not interpret and mosaic_gpu_available():  # the Mosaic GPU (Hopper) kernel beside the Triton one, with its
        # default 128-token KV blocks in 2 slots (one program per SM in shared memory) or 3 (two blocks in flight;
        # ~208 KiB at head 128), and 64-token blocks in 2 slots (two programs per SM) or 4 (one program per SM, 3
        # blocks in flight)
        impls["mosaic"] = (jax.jit(functools.partial(mosaic_decode_attention, scale=scale)),
                           (q, k_pages, v_pages, tables, lengths))
        impls["mosaic[3 slots]"] = (jax.jit(functools.partial(mosaic_decode_attention, scale=scale, slots=3)),
                                    (q, k_pages, v_pages, tables, lengths))
        for splits in (2, 8):  # each sequence's keys over several programs: batch x KV heads short of the SMs
            impls[f"mosaic[{splits} splits]"] = (
                jax.jit(functools.partial(mosaic_decode_attention, scale=scale, splits=splits)),
                (q, k_pages, v_pages, tables, lengths))
        for slots in (2, 4) if 64 % case.page_size == 0 else ():
            impls[f"mosaic[64-token blocks, {slots} slots]"] = (
                jax.jit(functools.partial(mosaic_decode_attention, scale=scale, pages_per_block=64 // case.page_size,
                                          slots=slots)),
                (q, k_pages, v_pages, tables, lengths))
    impls["jnp_reference"] = (jax.jit(functools.partial(decode_attention_reference, scale=scale)),
                              (q, k_pages, v_pages, tables, lengths))
    # the shipped kernel wants head-major pages [KVH, N, page, hd]; transposed outside the timed region
    k_head_major, v_head_major = (jnp.transpose(p, (2, 0, 1, 3)) for p in (k_pages, v_pages))
    q_scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)  # it has no softmax-scale argument
    impls["jax_shipped_paged_attention"] = (shipped_paged_attention(case.context, case.page_size, interpret),
                                            (q_scaled, k_head_major, v_head_major, tables, lengths))

    rows = _timed_rows(impls, args, {"kind": "decode", **dataclasses.asdict(case), "kv_bytes": kv_bytes},
                       lambda s: dict(gb_per_s=kv_bytes / s / 1e9,
                                      frac_of_copy_bw=kv_bytes / s / ceilings["copy_bytes_per_s"]))
    return _with_speedups(rows, "jax_shipped_paged_attention")


def _timed_rows(impls: dict, args: argparse.Namespace, fields: dict, rates) -> list[dict]:
    """Time each `name: (fn, fn_args)`, check it against impls["jnp_reference"], and add `rates(seconds)`."""
    expected = _reference_output(*impls["jnp_reference"])
    rows = []
    for name, (fn, fn_args) in impls.items():
        seconds = _try_time(fn, fn_args, args.warmup, args.iters)
        row = {**fields, "impl": name, "max_abs_err_vs_reference": _max_error(fn, fn_args, expected)}
        if isinstance(seconds, float):
            row.update(ms=seconds * 1e3, **rates(seconds))
        else:
            row["error"] = seconds
        rows.append(row)
    return rows


def prefill_flops(case: PrefillCase) -> float:
    """Causal attention FLOPs: 2 matmuls x 2 FLOP x heads x hd x visible (query, key) pairs."""
    pairs = case.tokens_per_seq * (case.tokens_per_seq + 1) // 2
    return 4.0 * case.seqs * pairs * case.kv_heads * case.gqa * case.head_dim


def bench_prefill(case: PrefillCase, ceilings: dict, args: argparse.Namespace, interpret: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    k_pages, v_pages, tables = _pool(rng, case.seqs, case.tokens_per_seq, case.page_size, case.kv_heads,
                                     case.head_dim)
    tokens = case.seqs * case.tokens_per_seq
    heads = case.kv_heads * case.gqa
    q = jax.random.normal(jax.random.key(1), (tokens, heads, case.head_dim), jnp.bfloat16)
    lens = jnp.full((case.seqs,), case.tokens_per_seq, jnp.int32)
    starts = jnp.arange(case.seqs, dtype=jnp.int32) * case.tokens_per_seq
    fn_args = (q, k_pages, v_pages, starts, lens, lens, tables)
    scale = case.head_dim ** -0.5

    def items(block_q: int) -> tuple[jax.Array, jax.Array]:
        """The kernel's work items for this batch at `block_q`, built on the host as the engine does."""
        return tuple(jnp.asarray(a) for a in ragged_items(np.asarray(lens), block_q, tokens, case.seqs))

    block_q = ragged_block_q(q.dtype, k_pages.dtype, heads, case.kv_heads, case.head_dim)
    impls = {"pallas": (jax.jit(functools.partial(ragged_paged_attention, interpret=interpret, scale=scale)),
                        fn_args + items(block_q))}
    if args.sweep and case in SWEEP_PREFILL:
        for block_q, ppb, warps, stages in itertools.product((16, 32, 64), (4, 8), (4, 8), (1, 2)):
            impls[f"pallas[block_q={block_q},pages_per_block={ppb},num_warps={warps},num_stages={stages}]"] = (
                jax.jit(functools.partial(ragged_paged_attention, interpret=interpret, block_q=block_q,
                                          pages_per_block=ppb, num_warps=warps, num_stages=stages, scale=scale)),
                fn_args + items(block_q))
    if not interpret and mosaic_gpu_available():  # the Mosaic GPU (Hopper) kernels: one warpgroup on items of 64
        # queries; two consumer warpgroups and a producer on items of 128
        impls["mosaic"] = (jax.jit(functools.partial(mosaic_ragged_paged_attention, scale=scale)),
                           fn_args + items(MOSAIC_BLOCK_Q))
        impls["mosaic_warp_specialized"] = (jax.jit(functools.partial(mosaic_ragged_ws_attention, scale=scale)),
                                            fn_args + items(MOSAIC_WS_BLOCK_Q))
        for variant, options in (("p through shared memory", dict(p_in_registers=False)),
                                 ("no turns", dict(ping_pong=False))):
            impls[f"mosaic_warp_specialized[{variant}]"] = (
                jax.jit(functools.partial(mosaic_ragged_ws_attention, scale=scale, **options)),
                fn_args + items(MOSAIC_WS_BLOCK_Q))
    if not interpret:
        flash = mosaic_flash_attention(q, k_pages, v_pages, tables, scale, seqs=case.seqs,
                                       tokens_per_seq=case.tokens_per_seq)
        if flash is not None:
            impls["jax_mosaic_gpu_flash_attention"] = flash
    impls["jnp_reference"] = (jax.jit(functools.partial(ragged_attention_reference, scale=scale,
                                                        max_q_len=case.tokens_per_seq)), fn_args)
    flops = prefill_flops(case)
    rows = _timed_rows(impls, args,
                       {"kind": "prefill", **dataclasses.asdict(case), "flops": flops},
                       lambda s: dict(tflop_per_s=flops / s / 1e12,
                                      frac_of_matmul=flops / s / ceilings["bf16_matmul_flops"]))
    return _with_speedups(rows, "jnp_reference")


def _with_speedups(rows: list[dict], baseline: str) -> list[dict]:
    base = next((r.get("ms") for r in rows if r["impl"] == baseline), None)
    for row in rows:
        if base and "ms" in row:
            row[f"speedup_vs_{baseline}"] = base / row["ms"]
    return rows


def bench_kv_write(tokens: int, args: argparse.Namespace, interpret: bool, pool_bytes: int) -> list[dict]:
    """Writing T tokens' K and V into a donated pool: XLA scatter vs the Pallas store kernel."""
    page_size, kv_heads, head_dim = 16, KV_HEADS, 128
    num_pages = max(pool_bytes // (page_size * kv_heads * head_dim * 2), tokens // page_size + 2)
    rng = np.random.default_rng(0)
    slots = jnp.asarray(page_size + rng.permutation((num_pages - 1) * page_size)[:tokens], jnp.int32)
    new = jax.random.normal(jax.random.key(0), (tokens, kv_heads, head_dim), jnp.bfloat16)
    rows = []
    for method in ("scatter", "kernel"):
        step = jax.jit(functools.partial(write_kv, method=method, interpret=interpret), donate_argnums=(0, 1))
        pools = [jnp.zeros((num_pages, page_size, kv_heads, head_dim), jnp.bfloat16) for _ in range(2)]
        times = []
        for i in range(args.warmup + args.iters):
            started = time.perf_counter()
            pools = jax.block_until_ready(step(*pools, new, new, slots))
            if i >= args.warmup:
                times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
        written = 2 * tokens * kv_heads * head_dim * 2
        rows.append({"kind": "kv_write", "tokens": tokens, "impl": method, "ms": seconds * 1e3,
                     "gb_per_s": written / seconds / 1e9})
        print(f"kv_write tokens={tokens:<5} pool={2 * num_pages * page_size * kv_heads * head_dim * 2 >> 20} MiB"
              f"  {method:<8} {seconds * 1e3:9.3f} ms  {written / seconds / 1e9:8.1f} GB/s written", flush=True)
        del pools
    return rows


# the decode target's shape (batch 64 x 2k context, GQA 4, head 128) first: a run cut short still measures it
SWEEP_DECODE = (DecodeCase(64, 2048, 128, 4), DecodeCase(1, 8192, 128, 4))
SWEEP_PREFILL = (PrefillCase(4, 1024, 128, 4),)


def cases(args: argparse.Namespace) -> tuple[list[DecodeCase], list[PrefillCase]]:
    if args.quick:
        return [DecodeCase(2, 64, 64, 4, kv_heads=2)], [PrefillCase(2, 32, 64, 4, kv_heads=2)]
    if args.full:
        decode = [DecodeCase(b, c, hd, g) for b in (1, 16, 64, 256) for c in (512, 2048, 8192)
                  for hd in (64, 128) for g in (4, 8)]
    else:
        decode = [DecodeCase(b, c, 128, 4) for b in (1, 16, 64, 256) for c in (512, 2048, 8192)]
        decode += [DecodeCase(64, 2048, 128, 8), DecodeCase(64, 2048, 64, 4), DecodeCase(64, 2048, 64, 8),
                   DecodeCase(64, 2048, 128, 4, page_size=32)]
    # pages of 64 tokens third: what 8 page copies per 128-token KV block (pages of 16) cost against 2
    prefill = [PrefillCase(1, 4096, 128, 4), PrefillCase(4, 1024, 128, 4),
               PrefillCase(1, 4096, 128, 4, page_size=64), PrefillCase(1, 4096, 128, 8), PrefillCase(1, 4096, 64, 4),
               PrefillCase(8, 512, 128, 4), PrefillCase(1, 8192, 128, 4)]
    return decode, prefill


def print_row(row: dict) -> None:
    if row["kind"] == "decode":
        shape = f"decode b={row['batch']:<3} ctx={row['context']:<5} hd={row['head_dim']:<3} gqa={row['gqa']} " \
                f"page={row['page_size']}"
        metric = f"{row.get('gb_per_s', 0):8.1f} GB/s  {100 * row.get('frac_of_copy_bw', 0):5.1f}% of copy BW"
        ratio = row.get("speedup_vs_jax_shipped_paged_attention")
    else:
        shape = f"prefill seqs={row['seqs']} x {row['tokens_per_seq']:<5} hd={row['head_dim']:<3} gqa={row['gqa']}"
        metric = f"{row.get('tflop_per_s', 0):8.2f} TFLOP/s {100 * row.get('frac_of_matmul', 0):5.1f}% of matmul"
        ratio = row.get("speedup_vs_jnp_reference")
    timing = f"{row['ms']:9.3f} ms  {metric}" if "ms" in row else row["error"]
    suffix = f"  x{ratio:.2f} vs baseline" if ratio else ""
    if row.get("max_abs_err_vs_reference") is not None:
        suffix += f"  err {row['max_abs_err_vs_reference']:.1e}"
    print(f"{shape:<48} {row['impl']:<44} {timing}{suffix}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode on CPU")
    parser.add_argument("--full", action="store_true", help="every decode combination (batch x ctx x hd x gqa)")
    parser.add_argument("--sweep", action="store_true", help="also time a few kernel block/split choices")
    parser.add_argument("--only", choices=["decode", "prefill", "kv_write"], help="run one kind")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds")
    parser.add_argument("--json", dest="json_path", help="write the results here (rewritten after every case)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.iters = args.iters if args.iters is not None else (2 if args.quick else 10)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.quick:
        parser.error("no GPU: the kernels would run in interpret mode; use --quick to smoke-test on CPU")
    interpret = not on_gpu

    device = jax.devices()[0]
    ceilings = measure_ceilings(args.quick, args.warmup, args.iters)
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, interpret={interpret}")
    probes = ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in ceilings["copy_probes_bytes_per_s"].items())
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s (the fastest of {probes}), "
          f"bf16 matmul {ceilings['bf16_matmul_flops'] / 1e12:.2f} TFLOP/s")
    decode, prefill = cases(args)
    rows = []
    result = {"device": device.device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
              "python": platform.python_version(), "interpret": interpret, "quick": args.quick,
              "ceilings": ceilings, "results": rows}
    started = time.perf_counter()
    # the targets' shapes first (decode at batch 64 x 2k, then prefill), so a run cut short by --budget-s has them
    first_decode = [case for case in decode if case == SWEEP_DECODE[0]]
    work = []
    if args.only in (None, "decode"):
        work += [functools.partial(bench_decode, case, ceilings, args, interpret) for case in first_decode]
    if args.only in (None, "prefill"):
        work += [functools.partial(bench_prefill, case, ceilings, args, interpret) for case in prefill]
    if args.only in (None, "decode"):
        work += [functools.partial(bench_decode, case, ceilings, args, interpret) for case in decode
                 if case not in first_decode]
    if args.only in (None, "kv_write"):
        pool_bytes = (1 << 20) if args.quick else (1 << 30)
        work += [functools.partial(bench_kv_write, tokens, args, interpret, pool_bytes)
                 for tokens in ((16,) if args.quick else (64, 256, 4096))]
    for measure in work:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            result["cut_short_by_budget_s"] = args.budget_s
            print(f"budget of {args.budget_s:.0f} s spent: the remaining cases are not run", flush=True)
            break
        for row in measure():
            if row["kind"] != "kv_write":
                print_row(row)
            rows.append(row)
        if args.json_path:
            with open(args.json_path, "w") as fh:
                json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
