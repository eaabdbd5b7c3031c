"""What bounds a wide decode step: the engine's step timed as is and with attention removed, in one process.

Two engines share the process: the real one (`xla` paged attention) and one whose attention backend reads no
pages (it returns the queries; the K/V pool writes still run). Both replay the same captured decode step of
`--rows` sequences, interleaved, so the difference is what paged attention costs at that context. From the
step times and the measured prefill of every prompt it prints the wide scenario's rate with real attention and with
attention for free, against a 750 tok/s target:

    python -m benchmarks.decode_floor --rows 64
"""
from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.common import command_line, machine_info, write_json
from benchmarks.step_profile import capture_decode_call, replay_seconds
from benchmarks.throughput import random_prompts, warm_then_time

NO_ATTENTION = "floor-no-attention"


def _register_no_attention_backend() -> None:
    """An attention backend that returns q unchanged (reads no pages) and writes K/V as `xla` does."""
    from jvllm.attention import SeparateWrite, register_backend
    from jvllm.attention import xla

    def attend(q, k, v, k_pages, v_pages, md, scale, sliding_window=None):  # noqa: ARG001 (AttendFn signature)
        return q

    register_backend(NO_ATTENTION, lambda: SeparateWrite(NO_ATTENTION, xla.class_layout, attend, xla.write_layers))


def _prefill_seconds(engine, rows: int, prompt_len: int, repeats: int) -> float:
    """Median seconds to prefill `rows` fresh prompts of `prompt_len` tokens (a generate with max_tokens=1:
    as many steps as max_num_batched_tokens needs), after a warm-up pass."""
    prompts = random_prompts(rows, prompt_len, engine.model.config.vocab_size, seed=2)
    return statistics.median(warm_then_time(engine, prompts, 1, repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="sequences in the decode step (the wide scenario's 64)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32,
                        help="tokens generated before the captured step: its context is prompt-len + output-len")
    parser.add_argument("--repeats", type=int, default=9, help="timed replays of each step (median)")
    parser.add_argument("--target", type=float, default=750.0, help="wide-scenario output tok/s to compare with")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    from jvllm import Engine

    _register_no_attention_backend()
    engine_args = dict(max_num_seqs=args.rows, max_model_len=4096, batched_weight_dtype="bfloat16")
    engines = {name: Engine(attention_backend=name, **engine_args) for name in ("xla", NO_ATTENTION)}
    calls = {name: capture_decode_call(e, args.rows, args.prompt_len, args.output_len) for name, e in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, engine in engines.items():
        replay_seconds(engine, calls[name])  # warm
    for _ in range(args.repeats):
        for name, engine in engines.items():
            times[name].append(replay_seconds(engine, calls[name]))
    step = {name: statistics.median(t) for name, t in times.items()}
    del engines[NO_ATTENTION]
    prefill = _prefill_seconds(engines["xla"], args.rows, args.prompt_len, repeats=3)

    # The wide scenario: one prefill of every prompt (it samples each first token), then wide_len - 1 decodes.
    wide_len = 64
    tokens = args.rows * wide_len

    def wide_rate(decode_step: float) -> float:
        return tokens / (prefill + (wide_len - 1) * decode_step)

    results = {
        "command": command_line("benchmarks.decode_floor", argv), "machine": machine_info(),
        "rows": args.rows, "context_tokens": args.prompt_len + args.output_len,
        "decode_step_ms": 1e3 * step["xla"], "decode_step_without_attention_ms": 1e3 * step[NO_ATTENTION],
        "attention_ms": 1e3 * (step["xla"] - step[NO_ATTENTION]),
        "prefill_ms": 1e3 * prefill, "prefill_tokens": args.rows * args.prompt_len,
        "wide_estimate_tokens_per_s": wide_rate(step["xla"]),
        "wide_estimate_without_attention_tokens_per_s": wide_rate(step[NO_ATTENTION]),
        "decode_step_needed_for_target_ms": 1e3 * (tokens / args.target - prefill) / (wide_len - 1),
    }
    print(f"decode step, {args.rows} rows x ~{results['context_tokens']} tokens of context "
          f"(median of {args.repeats}, interleaved):")
    print(f"  with paged attention   {results['decode_step_ms']:7.1f} ms")
    print(f"  attention removed      {results['decode_step_without_attention_ms']:7.1f} ms "
          f"-> attention costs {results['attention_ms']:.1f} ms")
    print(f"prefill of {args.rows} x {args.prompt_len} tokens: {results['prefill_ms']:.0f} ms")
    print(f"wide scenario ({args.rows} x {args.prompt_len} in x {wide_len} out) estimated from these steps: "
          f"{results['wide_estimate_tokens_per_s']:.0f} tok/s; with attention for free: "
          f"{results['wide_estimate_without_attention_tokens_per_s']:.0f} tok/s")
    print(f"{args.target:.0f} tok/s would need decode steps of {results['decode_step_needed_for_target_ms']:.1f} ms "
          f"after this prefill")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
