"""Embedding throughput: jvllm's Engine.embed vs sentence-transformers (PyTorch) on the same sentences, same run.

Both embed N short sentences (default 1,000, 5-20 words, fixed seed) with all-MiniLM-L6-v2; each side is
warmed up once (jvllm compiles its bucket shapes then), then timed as the best of --repeats runs. Prints
embeddings/s for both, the ratio, and the lowest cosine similarity between the two sides' embeddings.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best is kept")
    parser.add_argument("--batched-weight-dtype", default="none",
                        help="weights for batches of >= 512 padded tokens, e.g. bfloat16 (f32 accumulation); "
                             "'none' keeps float32 everywhere")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for the baseline")
    parser.add_argument("--no-baseline", action="store_true")
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
    if not args.no_baseline:
        from jvllm.model_loader.loader import resolve_model_path

        st, st_vectors = run_sentence_transformers(resolve_model_path(args.model)[0], sentences, args)
        cosine = np.sum(jv_vectors * st_vectors, axis=1) / (
            np.linalg.norm(jv_vectors, axis=1) * np.linalg.norm(st_vectors, axis=1))
        ratio = jv["embeddings_per_s"] / st["embeddings_per_s"]
        results.update(sentence_transformers=st, ratio=ratio, min_cosine_vs_sentence_transformers=float(cosine.min()))
        print(f"sentence-transformers: {st['embeddings_per_s']:.1f} embeddings/s (batch_size {args.st_batch_size}, "
              f"{args.threads} torch threads)", flush=True)
        print(f"ratio: jvllm is {ratio:.2f}x; min cosine vs sentence-transformers {cosine.min():.7f}", flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
