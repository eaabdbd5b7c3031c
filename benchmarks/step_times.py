"""Wall time of every device step by shape, for the fixed and varied workloads of benchmarks.traffic.

Each `ModelRunner.run_call` is timed up to `block_until_ready`, so this shows which step shapes a workload meets and
what each costs (async scheduling's overlap is lost while measuring).

    python -m benchmarks.step_times [--batched-weight-dtype bfloat16] [--kv-cache-dtype fp8_e5m2]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batched-weight-dtype", default=None, help="e.g. bfloat16 (default: the engine's)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8_e5m2 (default: auto)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args(argv)

    import jax

    from benchmarks import traffic, workloads
    from jvllm import Engine
    from jvllm.worker.model_runner import ModelRunner

    options = {} if args.batched_weight_dtype is None else {"batched_weight_dtype": args.batched_weight_dtype}
    engine = Engine(kv_cache_dtype=args.kv_cache_dtype, **options)
    vocab = engine.model.config.vocab_size
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    run_call = ModelRunner.run_call

    def timed(runner: ModelRunner, call, *rest):
        started = time.perf_counter()
        out = jax.block_until_ready(run_call(runner, call, *rest))
        seconds[str(call.shape)].append(time.perf_counter() - started)
        return out

    ModelRunner.run_call = timed
    n, total_in, total_out = args.num_prompts, args.num_prompts * args.input_len, args.num_prompts * args.output_len
    for name, workload in [("fixed", workloads.fixed(n, args.input_len, args.output_len, vocab, 150)),
                           ("varied", workloads.varied(n, total_in, total_out, vocab, 250))]:
        seconds.clear()
        wall = traffic.jvllm_pass(engine, workload)
        print(f"{name}: {wall:.2f} s wall, {sum(map(sum, seconds.values())):.2f} s in steps, "
              f"{workload.output_tokens} output tokens, longest output {max(workload.output_lens)}")
        for shape, times in sorted(seconds.items()):
            print(f"  {shape}: {len(times)} x {1000 * sum(times) / len(times):.1f} ms = {sum(times):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
