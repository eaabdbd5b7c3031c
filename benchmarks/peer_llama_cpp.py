"""Peer baseline: llama-cpp-python greedy fixed-length decode tok/s (run with the bench venv's python)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import llama_cpp

SEED = 1234
WARMUP_PROMPTS = ["Hello there!", "Name three colours."]


def greedy_generate(
    llm: llama_cpp.Llama, sampler: object, prompt: str, n: int
) -> tuple[int, list[int], float]:
    """Prefill `prompt`, then greedily generate exactly `n` tokens (EOS ignored): (n_prompt, tokens, secs)."""
    toks = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
    if len(toks) + n > llm.n_ctx():
        raise ValueError(f"prompt ({len(toks)}) + tokens ({n}) exceeds n_ctx ({llm.n_ctx()})")
    out: list[int] = []
    t0 = time.perf_counter()
    llm.reset()
    llm.eval(toks)
    for i in range(n):
        tok = int(llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1))
        out.append(tok)
        if i + 1 < n:
            llm.eval([tok])
    dt = time.perf_counter() - t0
    return len(toks), out, dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="path to a .gguf file")
    ap.add_argument("--tokens", type=int, default=128, help="tokens to generate per prompt (EOS ignored)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's context (prompt + generated tokens)")
    ap.add_argument("--first-is-warmup", action="store_true", help="run the first prompt untimed, as the warm-up")
    ap.add_argument("--prompts-json", required=True, help="JSON list of prompt strings (benchmarks/peers.py writes the timed ones)")
    args = ap.parse_args(argv)

    with open(args.prompts_json, encoding="utf-8") as f:
        prompts = [str(p) for p in json.load(f)]

    t_load = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
        n_batch=512, seed=SEED, verbose=False,
    )
    load_s = time.perf_counter() - t_load
    sampler = llama_cpp.llama_sampler_init_greedy()
    warmups = WARMUP_PROMPTS + prompts[:1] if args.first_is_warmup else WARMUP_PROMPTS
    prompts = prompts[1:] if args.first_is_warmup else prompts
    try:
        for p in warmups:
            greedy_generate(llm, sampler, p, 16)
        rates: list[float] = []
        for pass_idx in range(args.passes):
            for i, p in enumerate(prompts):
                n_prompt, out, dt = greedy_generate(llm, sampler, p, args.tokens)
                rate = len(out) / dt
                rates.append(rate)
                print(json.dumps({
                    "pass": pass_idx, "prompt_idx": i, "prompt_tokens": n_prompt,
                    "gen_tokens": len(out), "seconds": round(dt, 4), "tok_per_s": round(rate, 2),
                    "text_head": llm.detokenize(out[:12]).decode("utf-8", "replace"),
                }), flush=True)
    finally:
        llama_cpp.llama_sampler_free(sampler)

    print(json.dumps({
        "engine": "llama.cpp",
        "version": llama_cpp.__version__,
        "tokens": args.tokens,
        "tok_per_s_median": round(statistics.median(rates), 2),
        "tok_per_s_all": [round(r, 2) for r in rates],
        "threads": args.threads,
        "passes": args.passes,
        "n_prompts": len(prompts),
        "timing": "wall time of prefill + greedy decode of exactly `tokens` tokens (EOS ignored)",
        "model": os.path.basename(args.model),
        "load_s": round(load_s, 3),
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
