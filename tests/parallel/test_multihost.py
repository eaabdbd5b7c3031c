"""Several hosts: the step channel's framing, and two processes of 2 virtual CPU devices forming one tp=4 mesh
(rank 0 schedules and sends each step, rank 1 follows), through the Engine and through `jvllm generate|serve`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.parallel.processes import (REPO, UNEXPECTED_COMPILE, WORKER, WORKER_TIMEOUT_S, free_port, run_together,
                                      run_worker, worker_env as _env, worker_result as _result)
from tests.parallel.test_tensor_parallel import PROMPTS


def test_step_channel_framing(monkeypatch):
    """Messages of any size, heartbeats and shutdown survive the fixed-size first broadcast (+ the rest in
    chunks), with the follower passing buffers of exactly the leader's shapes (a collective's requirement), all
    of them sizes that the start-up warm-up broadcast (so none compiles while steps run)."""
    import numpy as np

    from jvllm.parallel import distributed

    monkeypatch.setattr(distributed, "_REST_MAX", 1 << 15)  # payloads past it go in several chunks
    wire: list[np.ndarray] = []
    monkeypatch.setattr(distributed, "broadcast_from_leader", lambda value: wire.append(value.copy()) or value)
    leader, follower = distributed.StepChannel(), distributed.StepChannel()
    follower.is_leader = False
    leader.warm_up()
    warmed = {value.size for value in wire}
    assert warmed == {16384, 4096, 8192, 32768}
    wire.clear()
    messages = [{"ids": np.arange(5)}, {"big": np.arange(50_000, dtype=np.int32)}, "x" * 16_368, "y" * 16_369,
                b"z" * (3 << 15)]
    for message in messages:
        leader.heartbeat()
        leader.send(message)
    leader.shutdown()
    leader.shutdown()  # idempotent
    sent = list(wire)
    assert {value.size for value in sent} <= warmed
    assert [value.size for value in sent].count(1 << 15) >= 2  # the long messages went in chunks

    def replay(value: np.ndarray) -> np.ndarray:
        recorded = sent.pop(0)
        assert (recorded.shape, recorded.dtype) == (value.shape, value.dtype)
        return recorded
    monkeypatch.setattr(distributed, "broadcast_from_leader", replay)
    got = [follower.receive() for _ in messages]
    assert follower.receive() is None and not sent
    np.testing.assert_array_equal(got[0]["ids"], messages[0]["ids"])
    np.testing.assert_array_equal(got[1]["big"], messages[1]["big"])
    assert got[2:] == messages[2:]


def test_hosts_trace_the_same_program_bytes_from_different_calls():
    """Rank 0 traces a step under `generate`, the followers under `follow`: once `initialize` has set this up,
    the programs' text (locations included) does not depend on the Python calls around the trace. jax 0.12.1
    hosts whose programs differ there never finish their first collective."""
    import jax
    import jax.numpy as jnp

    from jvllm.parallel import distributed

    def step(x):
        return jnp.sin(x) * 2

    def traced_text() -> str:
        jax.clear_caches()  # trace anew, as a fresh process would
        return jax.jit(step).lower(jnp.ones(3)).as_text(debug_info=True)

    def as_leader() -> str:
        return traced_text()

    def as_follower() -> str:
        return traced_text()

    before = jax.config.jax_traceback_in_locations_limit
    try:
        assert as_leader() != as_follower()  # tracebacks in the locations, by default
        distributed.same_programs_on_every_host()
        assert as_leader() == as_follower()
    finally:
        jax.config.update("jax_traceback_in_locations_limit", before)
        jax.clear_caches()


@pytest.mark.extended  # the same mesh, steps and shutdown with a vision-language model: test_multimodal_hosts.py
def test_two_processes_form_one_tp4_mesh_and_match_a_single_process(tiny_models):
    """2 processes x 2 CPU devices on loopback, gloo collectives: rank 0 generates, rank 1 follows its
    steps and exits when rank 0 shuts down; tokens equal a single process's TP=1 tokens."""
    model = tiny_models["llama_gqa"]
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, str(WORKER), "multihost",
                 json.dumps({"model": model, "tp": 4, "num_hosts": 2, "rank": rank, "coordinator": coordinator,
                             "prompts": PROMPTS})] for rank in (0, 1)]
    reference = run_worker("generate", {"model": model, "prompts": PROMPTS}, devices=1)
    ranks = run_together(commands, devices=2)
    leader, follower = [_result(*r) for r in ranks]
    assert not any(UNEXPECTED_COMPILE in stderr for _, stderr, _ in ranks)  # broadcasts compile at start
    assert (leader["devices"], leader["local_devices"]) == (4, 2)
    assert leader["tokens"] == reference["tokens"]
    assert follower["steps_followed"] > 0


def _serve_once(command_for_rank, prompt: str, http_port: int) -> tuple[str, list[int]]:
    """Start both ranks of `jvllm serve`, ask rank 0's HTTP server for one greedy completion, SIGTERM rank 0;
    -> (the completion's text, both ranks' exit codes)."""
    import time
    import urllib.request

    procs = [subprocess.Popen(command_for_rank(rank), env=_env(2), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while True:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5)
                break
            except OSError:
                time.sleep(1)
        body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        text = json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["text"]
        procs[0].send_signal(signal.SIGTERM)  # rank 0 drains, stops, and releases rank 1
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return text, codes


@pytest.mark.extended  # the engine across two hosts: the test above and test_multimodal_hosts.py
def test_cli_generate_and_serve_across_two_hosts_match_one(tiny_models):
    """`jvllm generate|serve --num-hosts 2 --host-rank R --coordinator ...`: rank 0 prints (or serves) the
    single-process text, rank 1 prints nothing; SIGTERM to the server's rank 0 ends both ranks with 0."""
    prompt = "The quick brown fox"
    engine_flags = ["--model", tiny_models["llama_gqa"], "--dtype", "float32", "--kv-cache-memory-bytes", "4m",
                    "--max-model-len", "128", "--no-precompile"]  # only the shapes met: a quicker start
    base = [sys.executable, "-m", "entrypoints.cli", "generate", prompt, "--max-tokens", "8", *engine_flags]
    single = run_together([base], devices=1)[0]
    assert single[2] == 0, single[1][-3000:]
    assert single[0].strip()

    def multihost(rank: int, coordinator: str) -> list[str]:
        return ["-tp", "4", "--num-hosts", "2", "--host-rank", str(rank), "--coordinator", coordinator]

    coordinator = f"127.0.0.1:{free_port()}"
    ranks = run_together([base + multihost(rank, coordinator) for rank in (0, 1)], devices=2)
    assert [r[2] for r in ranks] == [0, 0], [r[1][-3000:] for r in ranks]
    # gloo's C++ code logs its connections to stdout (from several threads, so even its lines can be cut
    # up), before the text, which is printed once generation is done
    assert ranks[0][0].endswith(single[0]) and single[0].strip() not in ranks[1][0]

    coordinator, http_port = f"127.0.0.1:{free_port()}", free_port()
    serve = [sys.executable, "-m", "entrypoints.cli", "serve", *engine_flags, "--port", str(http_port)]
    text, codes = _serve_once(lambda rank: serve + multihost(rank, coordinator), prompt, http_port)
    assert text == single[0].rstrip("\n")
    assert codes == [0, 0]
