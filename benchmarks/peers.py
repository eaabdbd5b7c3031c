"""Single-stream decode against llama.cpp on the same GGUF file: each engine in a fresh process, warmed up on other
prompts, then 4 prompts of uneven length x `--tokens` greedy tokens (prefill counted, EOS ignored), rounds
alternating between the engines; prints each round's median tok/s and jvllm / llama.cpp.

llama.cpp runs through llama-cpp-python built from source in its own virtualenv (never a jvllm dependency):
    python3.11 -m venv /work/bench-venvs/llama-cpp
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON" /work/bench-venvs/llama-cpp/bin/pip install \\
        --no-binary llama-cpp-python llama-cpp-python
    python -m benchmarks.peers --llama-python /work/bench-venvs/llama-cpp/bin/python
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
WARMUP_PROMPTS = ["Hello there!", "Name three colours."]
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea, in four lines, with a rhyme at the end of each pair of lines.",
    "Explain, step by step and in simple words, how a refrigerator keeps food cold, "
    "and why it needs electricity to do so.",
    "You are a helpful assistant. A user writes: I am planning a weekend trip to the mountains "
    "with two friends. We like hiking, good food and quiet places. We have a small car and a "
    "modest budget. Please suggest a plan for Saturday and Sunday, with rough timings.",
]


def run_jvllm(model: str | None, tokens: int, passes: int) -> dict:
    """In this process: the default LLM() on `model`, timed like peer_llama_cpp.py times llama.cpp."""
    from jvllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for prompt in WARMUP_PROMPTS:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(passes):
        for prompt in PROMPTS:
            started = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - started))
    return dict(engine="jvllm", tokens=tokens, tok_per_s_median=statistics.median(rates),
                tok_per_s_all=[round(r, 2) for r in rates], load_s=round(load_s, 1), weight_bytes=llm.weight_bytes)


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--llama-python", default="/work/bench-venvs/llama-cpp/bin/python",
                        help="python of the virtualenv with llama-cpp-python")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=2, help="passes over the prompts in each engine process")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per engine, alternating")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--run-jvllm", action="store_true", help=argparse.SUPPRESS)  # one jvllm process
    args = parser.parse_args()
    if args.run_jvllm:
        print(json.dumps(run_jvllm(args.model, args.tokens, args.passes)))
        return
    from jvllm.model_loader.default_model import default_model_path

    model = args.model or default_model_path()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(PROMPTS, f)
    commands = {
        "llama.cpp": [args.llama_python, str(HERE / "peer_llama_cpp.py"), "--model", model, "--tokens",
                      str(args.tokens), "--threads", str(args.threads), "--passes", str(args.passes),
                      "--prompts-json", f.name],
        "jvllm": [sys.executable, "-m", "benchmarks.peers", "--run-jvllm", "--model", model, "--tokens",
                  str(args.tokens), "--passes", str(args.passes)],
    }
    rounds: dict[str, list[dict]] = {name: [] for name in commands}
    for round_index in range(args.rounds):
        for name, command in commands.items():
            done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent, check=True)
            result = _last_json(done.stdout)
            rounds[name].append(result)
            print(f"round {round_index + 1} {name}: {result['tok_per_s_median']:.1f} tok/s "
                  f"(all {result['tok_per_s_all']})", flush=True)
    medians = {name: statistics.median(r["tok_per_s_median"] for r in results) for name, results in rounds.items()}
    ratio = medians["jvllm"] / medians["llama.cpp"]
    print(f"single stream, {args.tokens} tokens incl. prefill: jvllm {medians['jvllm']:.1f} tok/s, llama.cpp "
          f"{medians['llama.cpp']:.1f} tok/s -> {ratio:.2f}x")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(model=model, tokens=args.tokens, medians=medians,
                                                          ratio=round(ratio, 3), rounds=rounds), indent=1) + "\n")


if __name__ == "__main__":
    main()
