"""Replay speculative decoding offline: the engine's own Drafter (proposers, back-off) over recorded greedy outputs,
with step costs from a cost model, to compare policies in seconds instead of benchmark runs.

The outputs are those of `benchmarks.spec_decode`'s prompts (every kind's warm-up prompts first, as each engine there
sees them), recorded once with the default `LLM()` and kept in --outputs. A request's steps follow the engine's
single-stream rules: a verification step holds at most the engine's step rows (--step-rows), drafts and the known
token; a step without drafts is dispatched ahead of the previous step's token (async scheduling) unless the
drafter had a proposal from the tokens known at that time; a verification step is never followed by a look-ahead
step, so the step after it is scheduled once its tokens are known and either verifies new drafts or runs without
(a "fresh" step: its host work is not hidden). Costs are in one-token look-ahead steps; the defaults were measured
in the engine on the 2-core Zen 5 VM (2026-11-29, SmolLM2 Q4_1 at a few hundred tokens of context): a fresh step
1.05, a verification step of k drafts 1.26 + 0.165 k, prefill 0.077 per prompt token. On that VM the replay
reproduced the benchmark's measured ratios to within their run-to-run spread; on a faster day of the same VM it
was within 0.2 (low on three kinds of prompts of four): give the costs of the machine at hand (--verify-base ...)
when absolute ratios matter, rather than comparisons of policies. `python -m benchmarks.spec_step_costs` measures
them inside a speculating engine and prints them as --row-costs and --prefill-per-token (captured steps replayed
alone time the one-token step slower than the engine runs it, which understates verification steps). A verification step's cost is not linear in its
rows past 8 (the kernels switch from row loops to tiles, and steps come in 16-, 32-, ... token buckets):
--row-costs gives it by token rows instead (1 known token + the drafts; interpolated between the rows given), e.g.
as replays of captured steps measured it on that VM, against a one-token step (the same measurement for both):

    python -m benchmarks.spec_replay --outputs /tmp/spec_outputs.json
    python -m benchmarks.spec_replay --outputs /tmp/spec_outputs.json --setting '{"method": "ngram", "num_speculative_tokens": 3}'
    python -m benchmarks.spec_replay --outputs /tmp/spec_outputs.json \
        --row-costs 2:1.22,4:1.44,6:1.70,8:1.92,9:2.49,12:2.82,16:2.97,20:3.47,28:4.27,32:4.68
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import numpy as np

from benchmarks.spec_decode import SETTINGS, prompts


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Step costs in one-token look-ahead steps."""

    fresh: float = 1.05
    verify_base: float = 1.26
    verify_per_draft: float = 0.165
    prefill_per_token: float = 0.077
    # (token rows, cost) in increasing rows: a verification step's cost by its rows instead of base + per draft
    row_costs: tuple[tuple[int, float], ...] = ()

    def verify(self, num_drafts: int) -> float:
        if not self.row_costs:
            return self.verify_base + self.verify_per_draft * num_drafts
        rows = [(1, 1.0), *self.row_costs]
        return float(np.interp(num_drafts + 1, [r for r, _ in rows], [c for _, c in rows]))


def parse_row_costs(text: str) -> tuple[tuple[int, float], ...]:
    """'2:1.22,4:1.44,...' -> ((2, 1.22), (4, 1.44), ...), rows increasing from 2."""
    try:
        pairs = tuple((int(rows), float(cost)) for rows, cost in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"row costs are ROWS:COST pairs separated by commas, got {text!r}") from None
    if not pairs or pairs[0][0] < 2 or any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])):
        raise argparse.ArgumentTypeError(f"row costs need increasing rows from 2, got {text!r}")
    return pairs


@dataclasses.dataclass
class Replayed:
    """One request's replay: its cost, and its steps by kind."""

    cost: float
    decode_cost: float
    look_ahead: int = 0
    fresh: int = 0
    verify: int = 0


def record(path: pathlib.Path, max_tokens: int) -> dict:
    """Greedy outputs of every spec_decode prompt with the default LLM(): {kind: {"warm": [[prompt ids, output ids],
    ...], "measured": [...]}}, written to `path`."""
    from jvllm import LLM, SamplingParams

    engine = LLM()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    recorded: dict = {}
    for kind, (warm, measured) in prompts().items():
        recorded[kind] = {}
        for part, messages in (("warm", warm), ("measured", measured)):
            outs = engine.chat([[{"role": "user", "content": text}] for text in messages], params, use_tqdm=False)
            recorded[kind][part] = [[list(out.prompt_token_ids), list(out.outputs[0].token_ids)] for out in outs]
        print(f"recorded {kind}", flush=True)
    path.write_text(json.dumps(recorded))
    return recorded


def replay_request(drafter, request_id: str, prompt: list[int], output: list[int], costs: StepCosts) -> Replayed:
    """The steps one request takes with `drafter`, its output known: drafts of at most the drafter's step rows less
    the known token, as the engine's scheduler asks for a lone request."""
    from jvllm import SamplingParams
    from jvllm.core.request import Request

    request = Request(request_id, None, prompt, SamplingParams(temperature=0, max_tokens=len(output)), 0, 1 << 30)
    prefill = costs.prefill_per_token * len(prompt)
    done = Replayed(prefill, 0.0)
    look_ahead = not drafter.has_proposal(request)  # decided as the prefill step is dispatched
    request.output_token_ids.append(output[0])
    while len(request.output_token_ids) < len(output):
        known = len(request.output_token_ids)
        draft = None if look_ahead else drafter.propose(request, drafter.max_step_rows - 1)
        if draft is None:
            done.decode_cost += 1.0 if look_ahead else costs.fresh
            done.look_ahead += look_ahead
            done.fresh += not look_ahead
            look_ahead = not drafter.has_proposal(request)  # the next step, decided before this one's token is known
            request.output_token_ids.append(output[known])
            continue
        drafts = list(draft.token_ids)
        accepted = 0
        while accepted < len(drafts) and known + accepted < len(output) and drafts[accepted] == output[known + accepted]:
            accepted += 1
        drafter.record(request, len(drafts), accepted)
        done.decode_cost += costs.verify(len(drafts))
        done.verify += 1
        request.output_token_ids += output[known:known + accepted + 1]
        look_ahead = False
    drafter.finish(request)
    done.cost += done.decode_cost
    return done


def replay(recorded: dict, setting: dict | None, costs: StepCosts, step_rows: int) -> dict:
    """Every kind's requests in the benchmark's order (every kind's warm-up prompts, then the measured ones kind by
    kind) through one Drafter whose verification steps hold at most `step_rows` token rows -> {kind: totals}."""
    from jvllm.spec_decode.config import SpeculativeConfig
    from jvllm.spec_decode.drafter import Drafter

    drafter = None if setting is None else Drafter(SpeculativeConfig.parse(setting), max_step_rows=step_rows)
    if drafter is not None:
        for parts in recorded.values():
            for prompt, output in parts["warm"]:
                replay_request(drafter, "warm", prompt, output, costs)
    results = {}
    for kind, parts in recorded.items():
        total = Replayed(0.0, 0.0)
        tokens = 0
        for index, (prompt, output) in enumerate(parts["measured"]):
            if drafter is None:
                one = Replayed(costs.prefill_per_token * len(prompt) + len(output) - 1, len(output) - 1,
                               look_ahead=len(output) - 1)
            else:
                one = replay_request(drafter, f"{kind}-{index}", prompt, output, costs)
            for field in dataclasses.fields(Replayed):
                setattr(total, field.name, getattr(total, field.name) + getattr(one, field.name))
            tokens += len(output)
        results[kind] = {"tokens": tokens, **dataclasses.asdict(total)}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", required=True, help="recorded outputs (JSON); recorded there first if missing")
    parser.add_argument("--max-tokens", type=int, default=256, help="when recording")
    parser.add_argument("--setting", action="append", default=None, metavar="JSON",
                        help="a speculative_config to replay (repeatable; default: the benchmark's ngram and suffix)")
    for field in dataclasses.fields(StepCosts):
        if field.name != "row_costs":
            parser.add_argument("--" + field.name.replace("_", "-"), type=float, default=field.default)
    parser.add_argument("--row-costs", type=parse_row_costs, default=(), metavar="ROWS:COST,...",
                        help="a verification step's cost by token rows (replaces --verify-base/--verify-per-draft)")
    parser.add_argument("--step-rows", type=int, default=None,
                        help="the most token rows of a verification step (default: the engine's for the embedded "
                             "model on this machine, its batch-invariant step rows: 16 with AVX-512, 8 with AVX2)")
    args = parser.parse_args(argv)
    if args.step_rows is None:
        from models.quantized import invariant_step_rows

        args.step_rows = invariant_step_rows({"q4_1", "q8_0"})  # the embedded GGUF's block formats
    path = pathlib.Path(args.outputs)
    recorded = json.loads(path.read_text()) if path.exists() else record(path, args.max_tokens)
    costs = StepCosts(**{field.name: getattr(args, field.name) for field in dataclasses.fields(StepCosts)})
    settings = ([json.loads(text) for text in args.setting] if args.setting
                else [config for config in SETTINGS.values() if config is not None])
    off = replay(recorded, None, costs, args.step_rows)
    print(f"{'prompts':18s} {'setting':58s} {'ratio':>6s} {'decode':>6s}  steps: verify / fresh / look-ahead")
    for setting in settings:
        for kind, got in replay(recorded, setting, costs, args.step_rows).items():
            ratio, decode = off[kind]["cost"] / got["cost"], off[kind]["decode_cost"] / got["decode_cost"]
            print(f"{kind:18s} {json.dumps(setting)[:58]:58s} {ratio:6.2f} {decode:6.2f}  "
                  f"{got['verify']} / {got['fresh']} / {got['look_ahead']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
