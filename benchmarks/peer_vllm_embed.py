"""Peer baseline: vLLM CPU embeddings/s on sentences read from a JSON file (run with the bench venv's python; LD_PRELOAD
tcmalloc + libiomp5). Prints one JSON line: the best of --repeats timed runs after one warm-up run, and the path of
the embeddings it wrote (.npy, in input order) for the caller's cosine check.

    python benchmarks/peer_vllm_embed.py --model FOLDER --sentences in.json --out vectors.npy [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import time

# by path: the spawned engine process re-runs this script without its folder on sys.path
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_vllm_env.py"))["prepare"]()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the embedding model's HF folder")
    parser.add_argument("--sentences", required=True, help="a JSON list of strings")
    parser.add_argument("--out", required=True, help="where to write the embeddings [N, D] float32 (.npy)")
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype (auto: its default for the checkpoint)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import numpy as np
    import vllm
    from vllm import LLM

    with open(args.sentences) as f:
        sentences = json.load(f)
    started = time.perf_counter()
    llm = LLM(model=args.model, runner="pooling", dtype=args.dtype)
    start_seconds = time.perf_counter() - started
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    warm = time.perf_counter()
    llm.embed(sentences, use_tqdm=False)
    first_seconds = time.perf_counter() - warm
    best, outputs = float("inf"), None
    for _ in range(args.repeats):
        began = time.perf_counter()
        outputs = llm.embed(sentences, use_tqdm=False)
        best = min(best, time.perf_counter() - began)
    np.save(args.out, np.array([o.outputs.embedding for o in outputs], np.float32))
    print(json.dumps({"vllm_version": vllm.__version__, "dtype": dtype, "engine_start_seconds": start_seconds,
                      "first_run_seconds": first_seconds, "seconds": best,
                      "embeddings_per_s": len(sentences) / best, "vectors": args.out}), flush=True)


if __name__ == "__main__":
    main()
