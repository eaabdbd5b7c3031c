"""`jvllm bench startup`: starts `jvllm serve` several times and times each start to a healthy server and to its first
completion (the start-up phases it logs are kept in the results)."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np

from entrypoints.bench.report import print_table, save


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _one_start(serve_args: list[str], timeout_s: float) -> dict:
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "entrypoints.cli", "serve", "--port", str(port), *serve_args]
    started = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        healthy = None
        while healthy is None:
            if server.poll() is not None:
                raise RuntimeError(f"jvllm serve exited with code {server.returncode}:\n{server.stdout.read()[-2000:]}")
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"jvllm serve was not healthy within {timeout_s:.0f} s")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    healthy = time.perf_counter() - started
            except httpx.HTTPError:
                time.sleep(0.1)
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=120)
        reply.raise_for_status()
        first = time.perf_counter() - started
    finally:
        server.terminate()
        output = server.communicate(timeout=60)[0]
    return {"seconds_to_healthy": healthy, "seconds_to_first_token": first,
            "log": [line.strip() for line in output.splitlines() if "INFO" in line][-30:]}


def run_startup_bench(args: argparse.Namespace, serve_args: list[str]) -> int:
    runs = []
    for index in range(args.num_runs):
        run = _one_start(serve_args, args.timeout)
        runs.append(run)
        print(f"start {index + 1}: healthy after {run['seconds_to_healthy']:.1f} s, first token after "
              f"{run['seconds_to_first_token']:.1f} s", flush=True)
    healthy = [run["seconds_to_healthy"] for run in runs]
    first = [run["seconds_to_first_token"] for run in runs]
    print_table("Start-up", [("Starts", len(runs)), ("First start to healthy (s)", healthy[0]),
                             ("Median to healthy (s)", float(np.median(healthy))),
                             ("Median to first token (s)", float(np.median(first)))])
    save({"serve_args": serve_args, "runs": runs}, args.output_json)
    return 0
