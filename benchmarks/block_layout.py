"""The embedded model with its Q4_0 / Q4_1 projections (and, word-grouped, its Q8_0 table) in the kernels' layout for
this machine (interleaved by groups of 8 rows on AVX2 builds, by code words for 16 rows on AVX-512 builds with BF16:
models.quantized.native_layout) against the file's row-major blocks, in one process; or with `--against
projections-apart`, the default engine against one whose q, k and v stay three projections and gate and up two
(models.llama.fuse_projections bypassed); or with `--against one-row-float32`, against one whose one-token steps
read the float32 weights instead of the bf16 copy through the native product (models.bf16_rows bypassed); or with
`--against few-rows-xla`, against one whose steps of 2-4 token rows take XLA's bf16 dots instead of the native
product (cpu_kernels.bf16_rows.bf16_rows_preferred held at 1); or with `--against many-rows-xla`, against one
whose steps of 5+ rows take XLA's bf16 dots instead of the bf16 tiles (cpu_kernels.bf16_rows.bf16_tiles_available
held false). Any `--model` (a float checkpoint's folder, say).

Two `LLM()` engines with default settings, the second built with the layout choice (or the other feature)
bypassed; after a warm-up, each round times a single stream (a chat prompt, 128 greedy tokens, prefill included),
three uneven chats together x 128 tokens (decode steps of 3 rows), a batch of 32 uneven chat prompts x 64 tokens
and the prefill of one prompt of 1,100 random tokens (one output token: prompt tok/s) on both, each round's prompts
new, the engines' order reversed every other round (a drift of the machine's speed reaches both sides of the
ratio). Prints the medians and their ratios.

    python -m benchmarks.block_layout --rounds 6 --json benchmarks/results/block_layout_cpu.json
    python -m benchmarks.block_layout --against projections-apart [--model FOLDER]
    python -m benchmarks.block_layout --against one-row-float32 --model FLOAT_CHECKPOINT_FOLDER
    python -m benchmarks.block_layout --against few-rows-xla --model FLOAT_CHECKPOINT_FOLDER
    python -m benchmarks.block_layout --against many-rows-xla --model FLOAT_CHECKPOINT_FOLDER
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import command_line, machine_info, write_json
from benchmarks.workloads import chat_messages

PREFILL_TOKENS = 1100  # a prompt past a power of two: its step's bucket (2,048) is half padding


def _single(engine, messages: list[dict]) -> float:
    """One chat, 128 greedy tokens -> output tok/s."""
    from jvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    started = time.perf_counter()
    out = engine.chat(messages, params, use_tqdm=False)
    return len(out[0].outputs[0].token_ids) / (time.perf_counter() - started)


def _batch(engine, chats: list[list[dict]], tokens: int = 64) -> float:
    """Uneven chats in one batch, `tokens` greedy tokens each -> output tok/s."""
    from jvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = engine.chat(chats, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)


def _prefill(engine, seed: int, tokens: int = PREFILL_TOKENS) -> float:
    """One prompt of `tokens` random token ids, one output token -> prompt tok/s."""
    import numpy as np

    from jvllm import SamplingParams

    ids = np.random.default_rng(seed).integers(100, 10_000, tokens).tolist()
    started = time.perf_counter()
    engine.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return tokens / (time.perf_counter() - started)


def _engines(against: str, model: str | None):
    """(default engine, the engine it is compared with) and the block formats of each."""
    import cpu_kernels.bf16_rows
    import jvllm.worker.weights
    import models.layers
    import models.llama
    from jvllm import LLM
    from jvllm.worker.weights import block_formats

    native = LLM(model)
    choose, fuse = models.layers.native_layout, models.llama.fuse_projections
    one_row, preferred = jvllm.worker.weights.bf16_rows_available, cpu_kernels.bf16_rows.bf16_rows_preferred
    tiles = cpu_kernels.bf16_rows.bf16_tiles_available
    if against == "row-major":  # the file's blocks as they are, projections and table
        models.layers.native_layout = models.llama.native_layout = lambda blocks, fmt, table=False: (blocks, fmt)
    elif against == "one-row-float32":  # one-token steps on the float32 weights
        jvllm.worker.weights.bf16_rows_available = lambda: False
    elif against == "few-rows-xla":  # steps of 2-4 rows on XLA's bf16 dots
        cpu_kernels.bf16_rows.bf16_rows_preferred = lambda: 1
    elif against == "many-rows-xla":  # steps of 5+ rows on XLA's bf16 dots
        cpu_kernels.bf16_rows.bf16_tiles_available = lambda: False
    else:  # q, k and v as three projections, gate and up as two
        models.llama.fuse_projections = lambda module: (0, 0)
    try:
        other = LLM(model)
    finally:
        models.layers.native_layout = models.llama.native_layout = choose
        models.llama.fuse_projections = fuse
        jvllm.worker.weights.bf16_rows_available = one_row
        cpu_kernels.bf16_rows.bf16_rows_preferred = preferred
        cpu_kernels.bf16_rows.bf16_tiles_available = tiles
    formats = {name: sorted(block_formats(e.runner.loaded)) for name, e in (("native", native), (against, other))}
    return native, other, formats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default=None, help="the model of both engines (default: the embedded one)")
    parser.add_argument("--against", choices=["row-major", "projections-apart", "one-row-float32", "few-rows-xla",
                                              "many-rows-xla"],
                        default="row-major",
                        help="what the default engine is compared with (default: the file's row-major blocks)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    native, other, formats = _engines(args.against, args.model)
    print("block formats:", formats, flush=True)
    engines = {"native": native, args.against: other}
    for engine in engines.values():  # warm-up on prompts not timed
        _single(engine, chat_messages(1, seed=1000)[0])
        _batch(engine, chat_messages(3, seed=1002), tokens=128)
        _batch(engine, chat_messages(32, seed=1001))
        _prefill(engine, seed=1003)
    kinds = ("single", "three", "batch", "prefill")
    times: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in kinds} for name in engines}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        single_chat, batch_chats = chat_messages(1, seed=2 * r)[0], chat_messages(32, seed=2 * r + 1)
        three_chats = chat_messages(3, seed=1000 + 2 * r)
        for name in order:
            times[name]["single"].append(_single(engines[name], single_chat))
        for name in order:
            times[name]["three"].append(_batch(engines[name], three_chats, tokens=128))
        for name in order:
            times[name]["batch"].append(_batch(engines[name], batch_chats))
        for name in order:
            times[name]["prefill"].append(_prefill(engines[name], seed=3000 + r))
        print(f"round {r}: " + ", ".join(f"{name} " + " ".join(f"{kind} {t[kind][-1]:.1f}" for kind in kinds)
                                        for name, t in times.items()), flush=True)
    medians = {name: {kind: statistics.median(v) for kind, v in t.items()} for name, t in times.items()}
    ratios = {kind: medians["native"][kind] / medians[args.against][kind] for kind in kinds}
    for kind in kinds:
        print(f"{kind}: native {medians['native'][kind]:.1f} tok/s, {args.against} {medians[args.against][kind]:.1f} "
              f"tok/s -> {ratios[kind]:.2f}x")
    results = {"command": command_line("benchmarks.block_layout", argv), "machine": machine_info(),
               "formats": formats, "tok_s": times, "medians": medians, "ratios": ratios}
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
