"""Single-stream speed with speculative decoding against without, same run: copy-heavy prompts (a code edit, a summary
that quotes its source, JSON extraction) and free-form chat.

One `LLM()` per setting (default settings otherwise: the embedded SmolLM2-135M-Instruct), each warmed up on other
prompts of the same kind; then every prompt is sent alone through `chat` (greedy, up to --max-tokens) once per
setting, the settings in turn, their order reversed every other prompt (so that an engine's place in the process
weighs on every setting alike), and tokens per second are counted from the call to the last token, prefill included
(the last column: the share of the time without speculation that went to the prefill, which speculation cannot
shorten; a line after the table gives the ratios of the time after the first token alone). Every measured prompt
is new to every engine (the suffix method's cache of earlier outputs holds only other prompts' outputs).

    python -m benchmarks.spec_decode --json benchmarks/results/spec_decode_cpu.json
    python -m benchmarks.spec_decode --crossover 1,2,3,4,8 --rounds 10   # where speculation stops paying
    python -m benchmarks.spec_decode --draft-model SmolLM2-135M-Instruct   # also a draft model (3 drafts)
    python -m benchmarks.spec_decode --no-batch-invariant   # verification steps of up to 31 drafts, not invariant
    python -m benchmarks.spec_decode --workloads 3   # 32 chats and 256 requests: ngram against off, 3 rounds
    python -m benchmarks.spec_decode --workloads 3 --method suffix
    python -m benchmarks.spec_decode --batched-weight-dtype int8   # 8-bit products for prefill, every engine
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from benchmarks.common import command_line, machine_info, write_json

SETTINGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix": {"method": "suffix"},
}
PROMPTS = pathlib.Path(__file__).with_name("spec_decode_prompts.json")


def prompts() -> dict[str, list[list[str]]]:
    """Per kind, [warm-up prompts, measured prompts] (user messages), from PROMPTS: code edits of 30 lines of the
    project's source, summaries of design-note paragraphs, notes to extract as JSON, chat questions. The texts are
    those of the project's files at commit c51e86a, kept in the file so that edits of those files leave the
    benchmark's prompts as they are."""
    return json.loads(PROMPTS.read_text())


def run_one(engine, message: str, max_tokens: int) -> tuple[list[int], float, float]:
    """-> (output token ids, seconds from the call to the last token, of which to the first token: the prefill)."""
    from jvllm import SamplingParams

    started = time.perf_counter()
    out = engine.chat([{"role": "user", "content": message}], SamplingParams(temperature=0, max_tokens=max_tokens),
                      use_tqdm=False)[0]
    wall = time.perf_counter() - started
    return out.outputs[0].token_ids, wall, min(wall, out.metrics.time_to_first_token or 0.0)


def crossover(max_tokens: int, batch_sizes: list[int], rounds: int) -> dict:
    """Batches of b copy-heavy prompts at once, ngram speculation in every batch (max_batch_size lifted) against
    none, in one process, `rounds` rounds (each a different set of prompts, the engines' order reversed every
    other round): where verifying drafts stops paying for itself.
    -> {b: {"off": tok/s, "ngram": tok/s, "ratio": ..., "rounds": [[off, ngram] tok/s per round]}}."""
    from jvllm import LLM, SamplingParams

    engines = {"off": LLM(), "ngram": LLM(speculative_config={**SETTINGS["ngram"], "max_batch_size": 256})}
    edits, quotes = prompts()["code edit"][1], prompts()["quote summary"][1]
    messages = [[{"role": "user", "content": text}] for pair in zip(edits, quotes) for text in pair]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for engine in engines.values():
        engine.chat(messages[:2], params, use_tqdm=False)
    tokens = {(size, name): 0 for size in batch_sizes for name in engines}
    seconds = {(size, name): 0.0 for size in batch_sizes for name in engines}
    table = {size: {"rounds": []} for size in batch_sizes}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for size in batch_sizes:
            batch = [messages[(i + 3 * round_index) % len(messages)] for i in range(size)]
            rates = {}
            for name in order:
                started = time.perf_counter()
                outs = engines[name].chat(batch, params, use_tqdm=False)
                elapsed = time.perf_counter() - started
                count = sum(len(o.outputs[0].token_ids) for o in outs)
                tokens[size, name] += count
                seconds[size, name] += elapsed
                rates[name] = count / elapsed
            table[size]["rounds"].append([rates["off"], rates["ngram"]])
            print(f"round {round_index + 1} batch {size:3d}: off {rates['off']:7.1f} tok/s, ngram "
                  f"{rates['ngram']:7.1f} ({rates['ngram'] / rates['off']:4.2f}x)", flush=True)
    for size in batch_sizes:
        row = table[size]
        row["off"], row["ngram"] = (tokens[size, name] / seconds[size, name] for name in ("off", "ngram"))
        row["ratio"] = row["ngram"] / row["off"]
        print(f"batch {size:3d}: off {row['off']:7.1f} tok/s, ngram {row['ngram']:7.1f} ({row['ratio']:.3f}x)")
    return table


def many_requests(rounds: int, method: str = "ngram") -> dict:
    """Batches larger than the speculating batch size, in one process: `method` (SETTINGS) against no speculation,
    alternating which goes first each round, on 32 uneven chat prompts x 64 tokens, the same prompts with
    long-tailed output lengths (16-256, 64 on average: a few long answers run alone at the end, where the batch
    speculates), and 256 requests of fixed (64 in, 64 out) and varied (log-normal, same totals) lengths, as
    benchmarks.throughput builds them.
    -> {workload: {"off": [tok/s per round], method: [...], "ratio": sum method / sum off,
    "verification_steps": [steps that verified drafts, per round of `method`]}}: where that count is 0 the two
    engines ran the same steps, and their ratio is the machine's noise."""
    from jvllm import LLM
    from benchmarks import traffic, workloads

    engines = {"off": LLM(), method: LLM(speculative_config=SETTINGS[method])}
    vocab = engines["off"].model.config.vocab_size
    tokenizer = engines["off"].get_tokenizer()
    loads = {"32 chats": workloads.chat(tokenizer, 32, 64, seed=0),
             "32 chats varied": workloads.chat_varied(tokenizer, 32, 64 * 32, seed=0),
             "256 fixed": workloads.fixed(256, 64, 64, vocab, seed=100),
             "256 varied": workloads.varied(256, 64 * 256, 64 * 256, vocab, seed=200)}

    def tokens_per_second(engine, load) -> float:
        engine.reset_prefix_cache()  # every round computes the same prompts in full
        return load.output_tokens / traffic.jvllm_pass(engine, load)

    def verification_steps() -> int:
        return engines[method].drafter.stats.num_drafts

    for load in loads.values():  # warm-up: every step shape the workloads need
        for engine in engines.values():
            tokens_per_second(engine, load)
    table = {name: {"off": [], method: [], "verification_steps": []} for name in loads}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name, load in loads.items():
            verified_before = verification_steps()
            for setting in order:
                table[name][setting].append(tokens_per_second(engines[setting], load))
            table[name]["verification_steps"].append(verification_steps() - verified_before)
            print(f"round {round_index + 1} {name:15s} off {table[name]['off'][-1]:6.1f} tok/s, "
                  f"{method} {table[name][method][-1]:6.1f} ({table[name]['verification_steps'][-1]} steps "
                  "verified drafts)", flush=True)
    for name, row in table.items():
        row["ratio"] = sum(row[method]) / sum(row["off"])
        print(f"{name:15s} {method} / off {row['ratio']:.3f}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--rounds", type=int, default=5,
                        help="with --crossover: rounds over the batch sizes (the VM's noise needs several)")
    parser.add_argument("--crossover", default=None, metavar="SIZES",
                        help="instead: batches of these sizes (e.g. 1,2,4,8,16) with and without ngram speculation")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                        help="every engine with batch_invariant on or off (default: the engine's, on for GGUF blocks "
                             "on CPUs with AVX-512 or AVX2, where greedy outputs are then the same with and without)")
    parser.add_argument("--draft-model", default=None, metavar="MODEL",
                        help="also measure method draft_model with this draft (3 drafts a step)")
    parser.add_argument("--workloads", type=int, default=None, metavar="ROUNDS",
                        help="instead: 32 chats and 256 requests, --method against off in one process, ROUNDS rounds")
    parser.add_argument("--method", choices=["ngram", "suffix"], default="ngram",
                        help="the method --workloads measures (default ngram)")
    parser.add_argument("--batched-weight-dtype", default=None,
                        help="every engine's batched_weight_dtype (e.g. int8: 8-bit products for prefill; default: "
                             "the engine's)")
    args = parser.parse_args(argv)
    if args.workloads:
        table = many_requests(args.workloads, args.method)
        write_json(args.json, {"command": command_line("benchmarks.spec_decode", argv), "machine": machine_info(),
                               "workloads": table})
        return 0
    if args.crossover:
        table = crossover(args.max_tokens, [int(size) for size in args.crossover.split(",")], args.rounds)
        write_json(args.json, {"command": command_line("benchmarks.spec_decode", argv), "machine": machine_info(),
                               "max_tokens": args.max_tokens, "batches": table})
        return 0

    from jvllm import LLM

    settings = dict(SETTINGS)
    if args.draft_model:
        settings["draft_model"] = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": 3}
    options = {} if args.batched_weight_dtype is None else {"batched_weight_dtype": args.batched_weight_dtype}
    engines = {name: LLM(speculative_config=config, batch_invariant=args.batch_invariant, **options)
               for name, config in settings.items()}
    kinds = prompts()
    for engine in engines.values():
        for warm, _ in kinds.values():
            for message in warm:
                run_one(engine, message, args.max_tokens)
    tokens = {(kind, name): 0 for kind in kinds for name in engines}
    seconds = {(kind, name): 0.0 for kind in kinds for name in engines}
    prefill = {(kind, name): 0.0 for kind in kinds for name in engines}
    same = {(kind, name): 0 for kind in kinds for name in engines}  # prompts whose tokens equal those without
    for kind, (_, measured) in kinds.items():
        for index, message in enumerate(measured):
            outputs = {}
            for name in list(engines) if index % 2 == 0 else list(reversed(engines)):
                outputs[name], wall, to_first = run_one(engines[name], message, args.max_tokens)
                tokens[kind, name] += len(outputs[name])
                seconds[kind, name] += wall
                prefill[kind, name] += to_first
            for name in engines:
                same[kind, name] += outputs[name] == outputs["off"]
    results = {"command": command_line("benchmarks.spec_decode", argv), "machine": machine_info(),
               "settings": settings, "max_tokens": args.max_tokens, "kinds": {}}
    print(f"{'prompts':18s} " + " ".join(f"{name:>16s}" for name in engines) + "  prefill share (off)")
    decode_ratios = {}  # the time after each prompt's first token alone: what speculation can shorten
    for kind in kinds:
        row = {name: tokens[kind, name] / seconds[kind, name] for name in engines}
        decode = {name: tokens[kind, name] / max(seconds[kind, name] - prefill[kind, name], 1e-9) for name in engines}
        decode_ratios[kind] = {name: decode[name] / decode["off"] for name in engines}
        results["kinds"][kind] = {name: {"tok_s": row[name], "tokens": tokens[kind, name],
                                         "ratio_to_off": row[name] / row["off"], "prompts": len(kinds[kind][1]),
                                         "prefill_share": prefill[kind, name] / seconds[kind, name],
                                         "decode_ratio_to_off": decode_ratios[kind][name],
                                         "same_tokens_as_off": same[kind, name]} for name in engines}
        print(f"{kind:18s} " + " ".join(f"{row[name]:7.1f} ({row[name] / row['off']:4.2f}x)" for name in engines)
              + f"  {prefill[kind, 'off'] / seconds[kind, 'off']:.2f}")
    print("after the first token alone: " + "; ".join(
        f"{kind} " + " ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items() if name != "off")
        for kind, ratios in decode_ratios.items()))
    for name, engine in engines.items():
        if engine.drafter is not None:
            stats = engine.drafter.stats
            results.setdefault("acceptance", {})[name] = {
                "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                "num_accepted_tokens": stats.num_accepted_tokens, "mean_accepted_length": stats.mean_accepted_length}
            print(f"{name}: acceptance {stats.acceptance_rate:.2f}, mean accepted length "
                  f"{stats.mean_accepted_length:.2f}")
    for name in engines:
        equal = sum(same[kind, name] for kind in kinds)
        print(f"{name}: {equal} of {sum(len(m) for _, m in kinds.values())} outputs token for token as without")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
