"""`jvllm bench throughput | latency | serve | startup`: vLLM's benchmark commands and flags, for jvllm."""
from __future__ import annotations

import argparse
import os

from entrypoints.bench.datasets import add_dataset_flags

_HELP = """\
Measure jvllm (or any OpenAI-compatible server) the way `vllm bench` does:
  jvllm bench throughput --num-prompts 200 --input-len 128 --output-len 128   (offline, every request at once)
  jvllm bench latency --batch-size 8 --input-len 32 --output-len 128           (one batch, end to end)
  jvllm bench serve --base-url http://localhost:8000 --request-rate 4          (streams to a running server)
  jvllm bench startup --num-runs 3 -- --max-num-seqs 64                        (starts `jvllm serve` and times it)
Results print as a table; --output-json / --save-result write them as JSON."""


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from jvllm.engine.arg_utils import MULTIHOST_FIELDS, EngineArgs

    bench = commands.add_parser("bench", help="benchmark throughput, latency, a server or start-up",
                                description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)

    throughput = kinds.add_parser("throughput", help="offline throughput: every request at once through LLM.generate")
    add_dataset_flags(throughput, seed_flag=False)
    throughput.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    throughput.add_argument("--output-json", default=None, help="write the results here")
    throughput.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(throughput, skip=MULTIHOST_FIELDS)

    latency = kinds.add_parser("latency", help="the end-to-end time of one batch, over several iterations")
    add_dataset_flags(latency, seed_flag=False)
    latency.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default 8)")
    latency.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first (default 2)")
    latency.add_argument("--num-iters", type=int, default=5, help="timed iterations (default 5)")
    latency.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    latency.add_argument("--output-json", default=None, help="write the results here")
    EngineArgs.add_cli_args(latency, skip=MULTIHOST_FIELDS)

    serve = kinds.add_parser("serve", help="stream requests to a running OpenAI-compatible server")
    add_dataset_flags(serve)
    serve.add_argument("--base-url", default=None, help="the server, e.g. http://localhost:8000 (default: --host "
                                                        "and --port)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--endpoint", default="/v1/completions", help="the completions route (default /v1/completions)")
    serve.add_argument("--model", default=None, help="model name in the requests (default: the server's first)")
    serve.add_argument("--tokenizer", default=None, help="tokenizer of the prompts: a HF folder or .gguf (default: "
                                                         "the embedded model's)")
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("JVLLM_API_KEY"),
                       help="bearer key (default: $OPENAI_API_KEY, else $JVLLM_API_KEY)")
    serve.add_argument("--request-rate", type=float, default=float("inf"),
                       help="requests per second, Poisson arrivals (default inf: all at once)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    serve.add_argument("--save-result", action="store_true", help="write the results as JSON in --result-dir")
    serve.add_argument("--result-dir", default=None, help="folder of --save-result (default: here)")
    serve.add_argument("--result-filename", default=None, help="file name of the results (implies --save-result)")
    serve.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    startup = kinds.add_parser("startup", help="start `jvllm serve` several times; time to healthy and first token")
    startup.add_argument("--num-runs", type=int, default=3, help="starts (default 3; the first may compile)")
    startup.add_argument("--timeout", type=float, default=600, help="seconds a start may take (default 600)")
    startup.add_argument("--output-json", default=None, help="write the results here")
    startup.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags for `jvllm serve`")


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "throughput":
        from entrypoints.bench.offline import run_throughput

        return run_throughput(args)
    if args.bench_command == "latency":
        from entrypoints.bench.offline import run_latency

        return run_latency(args)
    if args.bench_command == "serve":
        from entrypoints.bench.serve import run_serve_bench

        return run_serve_bench(args)
    from entrypoints.bench.startup import run_startup_bench

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    return run_startup_bench(args, serve_args)
