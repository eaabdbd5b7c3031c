"""A speculating engine's own step costs, for `benchmarks.spec_replay`: each step of a single stream timed inside the
engine (its whole `_step`: host work, dispatch and reading results), grouped by the token rows of the first step
that `_step` dispatches (1: a one-token step; 1 + k: a step verifying k drafts), relative to the one-token steps'
median; the one-token steps right after a verification step apart (--fresh: nothing was dispatched ahead of them,
so their host work is not hidden); and the prefill's seconds per prompt token in the same units.

Replaying one captured step alone (`benchmarks.step_profile.replay_seconds`) times a one-token step slower than the
engine runs it (on the 2-core Zen 4 VM, 2026-12-02: 8.2 against 6.4 ms), so ratios made from replays understate
what verification steps cost; these are the costs to give the replay.

    python -m benchmarks.spec_step_costs [--method suffix] [--kind "code edit"] [--prompts 2]
    python -m benchmarks.spec_replay --outputs /tmp/spec_outputs.json --row-costs ... --prefill-per-token ... --fresh ...
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

from benchmarks.common import command_line, machine_info, write_json
from benchmarks.spec_decode import SETTINGS, prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["off", "ngram", "suffix"], default="suffix")
    parser.add_argument("--kind", default="code edit", help="the spec_decode prompts to run (default: code edit)")
    parser.add_argument("--prompts", type=int, default=2, help="measured prompts of that kind (after one warm-up)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", dest="json_path", help="write the results here")
    args = parser.parse_args(argv)

    from jvllm import LLM, SamplingParams

    engine = LLM(speculative_config=SETTINGS[args.method])
    warm, measured = prompts()[args.kind]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engine.chat([{"role": "user", "content": warm[0]}], params, use_tqdm=False)

    walls: dict[int, list[float]] = collections.defaultdict(list)
    fresh: list[float] = []  # one-token steps right after a verification step (not dispatched ahead)
    prefill_tokens, prefill_seconds = 0, 0.0
    run_call, step = engine.runner.run_call, engine._step
    current: list = []
    previous_rows = 0

    def recording_run_call(call, *rest, **options):
        current.append(call)
        return run_call(call, *rest, **options)

    def timed_step(*rest, **options):
        nonlocal prefill_tokens, prefill_seconds, previous_rows
        current.clear()
        started = time.perf_counter()
        out = step(*rest, **options)
        wall = time.perf_counter() - started
        if current:
            q_lens = current[0].metadata.q_lens
            cached = int(current[0].metadata.kv_lens.max()) - int(q_lens.max())
            rows = int(q_lens.max())
            if cached == 0 or rows > 32:  # a prompt's chunk
                prefill_tokens += int(q_lens.sum())
                prefill_seconds += wall
            elif rows == 1 and previous_rows > 1:
                fresh.append(wall)
            else:
                walls[rows].append(wall)
            previous_rows = rows
        return out

    engine.runner.run_call, engine._step = recording_run_call, timed_step
    try:
        for message in measured[:args.prompts]:
            engine.chat([{"role": "user", "content": message}], params, use_tqdm=False)
    finally:
        engine.runner.run_call, engine._step = run_call, step
    if 1 not in walls:
        print("no one-token steps were run: nothing to compare with", file=sys.stderr)
        return 1
    one = statistics.median(walls[1])
    costs = {rows: statistics.median(times) / one for rows, times in sorted(walls.items()) if rows > 1}
    for rows, times in sorted(walls.items()):
        print(f"{rows:2d} token rows: {len(times):3d} steps, median {statistics.median(times) * 1e3:6.2f} ms "
              f"({statistics.median(times) / one:.2f} one-token steps)")
    fresh_cost = statistics.median(fresh) / one if fresh else 1.0
    if fresh:
        print(f" 1 token row after a verification step: {len(fresh):3d} steps, median "
              f"{statistics.median(fresh) * 1e3:6.2f} ms ({fresh_cost:.2f} one-token steps)")
    row_costs = ",".join(f"{rows}:{cost:.2f}" for rows, cost in costs.items())
    per_token = prefill_seconds / prefill_tokens / one if prefill_tokens else 0.0
    print(f"--row-costs {row_costs} --prefill-per-token {per_token:.3f} --fresh {fresh_cost:.2f}")
    write_json(args.json_path, {"command": command_line("benchmarks.spec_step_costs", argv),
                                "machine": machine_info(), "one_token_step_ms": one * 1e3, "row_costs": costs,
                                "fresh": fresh_cost, "prefill_per_token": per_token,
                                "steps": {rows: len(t) for rows, t in walls.items()}, "fresh_steps": len(fresh)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
