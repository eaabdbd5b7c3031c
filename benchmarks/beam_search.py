"""Beam search on the default model against transformers' `generate(num_beams=...)` on the same weights, same run.

Prompts of uneven lengths; each engine warms up on other prompts first, and the timed pass is the first on the
measured ones. transformers runs the GGUF dequantized to float32 (its only way to read it), one prompt at a time as
its beam search takes them. Prints both times, the ratio and whether the best beams agree."""
from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import command_line, machine_info, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time in a small village near the river,",
           "The three laws of motion are", "Write a haiku about autumn leaves falling on a quiet pond:",
           "Q: What is the boiling point of water at sea level?\nA:"]
WARM_UP = ["Hello there, my friend", "import numpy as np", "In the beginning of the year the committee decided"]


def run_jvllm(prompts: list[str], warm_up: list[str], beam_width: int, max_tokens: int) -> tuple[float, list]:
    from jvllm import LLM, BeamSearchParams

    llm = LLM()
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    llm.beam_search(warm_up, params)
    started = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    return time.perf_counter() - started, [o.sequences[0].tokens for o in outputs]


def run_transformers(prompts: list[str], warm_up: list[str], beam_width: int, max_tokens: int) -> tuple[float, list]:
    import torch
    import transformers

    from jvllm.model_loader.default_model import default_model_path

    torch.set_num_threads(os.cpu_count() or 1)
    folder, name = os.path.split(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)

    def search(texts: list[str]) -> list[list[int]]:
        best = []
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, num_beams=beam_width, num_return_sequences=1, max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False, early_stopping=False)
            best.append(out[0].tolist())
        return best

    search(warm_up)
    started = time.perf_counter()
    best = search(prompts)
    return time.perf_counter() - started, best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    ours, our_best = run_jvllm(PROMPTS, WARM_UP, args.beam_width, args.max_tokens)
    print(f"jvllm LLM().beam_search: {len(PROMPTS)} prompts x {args.beam_width} beams x {args.max_tokens} tokens "
          f"in {ours:.2f} s", flush=True)
    theirs, their_best = run_transformers(PROMPTS, WARM_UP, args.beam_width, args.max_tokens)
    agree = sum(a == b for a, b in zip(our_best, their_best))
    print(f"transformers generate(num_beams={args.beam_width}): {theirs:.2f} s")
    print(f"jvllm is {theirs / ours:.2f}x transformers; best beams equal for {agree} of {len(PROMPTS)} prompts")
    write_json(args.json, {"command": command_line("benchmarks.beam_search", argv), "machine": machine_info(),
                           "prompts": len(PROMPTS), "beam_width": args.beam_width, "max_tokens": args.max_tokens,
                           "jvllm_seconds": ours, "transformers_seconds": theirs, "ratio": theirs / ours,
                           "best_beams_equal": agree})
    return 0


if __name__ == "__main__":
    sys.exit(main())
