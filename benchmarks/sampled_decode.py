"""What sampling costs a batch: out tok/s of the default engine with greedy decoding against temperature + top-p.

Each setting runs the same 64 chat prompts (uneven lengths) x 64 new tokens after an untimed pass of the same
kind; the ratio to greedy is what temperature, truncation and the random draw cost per step.

    python -m benchmarks.sampled_decode [--num-prompts 64] [--output-len 64] [--repeats 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

QUESTIONS = ["Write a short poem about the sea.", "Explain how a bicycle works.",
             "What is the capital of France and why is it famous?", "Tell me a story about a dragon and a knight.",
             "Give three tips for learning a new language, with an example for each.", "What is photosynthesis?",
             "Describe your ideal weekend in a few sentences.", "How do I boil an egg?"]
SETTINGS = {"greedy": {"temperature": 0.0}, "t0.7_p0.95": {"temperature": 0.7, "top_p": 0.95},
            "t1.0_p0.95": {"temperature": 1.0, "top_p": 0.95}, "t1.0_k50": {"temperature": 1.0, "top_k": 50}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per setting (the best is reported)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    from jvllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM()
    start_s = time.perf_counter() - started
    conversations = [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"}]
                     for i in range(args.num_prompts)]
    results: dict[str, dict] = {}
    for name, setting in SETTINGS.items():
        passes = []
        for attempt in range(args.repeats + 1):  # the first pass is the untimed warm-up
            params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=1000 * attempt + i,
                                     **setting) for i in range(args.num_prompts)]
            llm.reset_prefix_cache()
            begun = time.perf_counter()
            outputs = llm.chat(conversations, params, use_tqdm=False)
            seconds = time.perf_counter() - begun
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if attempt:
                passes.append(round(tokens / seconds, 1))
        results[name] = {"sampling": setting, "out_tok_s": max(passes), "passes": passes}
        ratio = max(passes) / results["greedy"]["out_tok_s"]
        print(f"{name:12s} {max(passes):8.1f} out tok/s  (passes {passes}; {ratio:.2f}x greedy)", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": "python -m benchmarks.sampled_decode", "args": vars(args), "start_s": round(start_s, 1),
                       "machine": platform.processor() or platform.machine(), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
