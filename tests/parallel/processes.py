"""Running tests/parallel/tp_worker.py scenarios in subprocesses of N virtual CPU devices each, alone or several
at once (the processes of one multi-host mesh), and reading back their one JSON result line."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "parallel" / "tp_worker.py"
RESULT_PREFIX = "TP_WORKER_RESULT "
WORKER_TIMEOUT_S = 600
UNEXPECTED_COMPILE = "XLA compiled an executable after start-up"  # jvllm.worker.compile_watch's warning


def worker_env(devices: int) -> dict[str, str]:
    """This process's environment for a worker of `devices` virtual CPU devices, offline, the repository importable."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def worker_result(stdout: str, stderr: str, returncode: int) -> dict:
    """The JSON result a worker printed (AssertionError with its stderr's tail if it failed)."""
    assert returncode == 0, f"worker failed ({returncode}):\n{stderr[-4000:]}"
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, f"no result line:\n{stdout[-2000:]}\n{stderr[-2000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def run_worker(scenario: str, args: dict, devices: int) -> dict:
    """Run one scenario in one worker process; -> its result."""
    proc = subprocess.run([sys.executable, str(WORKER), scenario, json.dumps({**args, "devices": devices})],
                          env=worker_env(devices), cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    return worker_result(proc.stdout, proc.stderr, proc.returncode)


def run_together(commands: list[list[str]], devices: int) -> list[tuple[str, str, int]]:
    """Start every command at once (one process group each); kill them all if one outlives the timeout."""
    procs = [subprocess.Popen(cmd, env=worker_env(devices), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for cmd in commands]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
            results.append((out, err, proc.returncode))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
