"""`jvllm serve` as a real process (SIGTERM drains open streams, exit 0) and `jvllm chat` both ways."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from typing import Iterator

import httpx
import pytest

from entrypoints.cli import main
from tests.server.conftest import API_KEY, MODEL, wait_until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_and_chat_help_explain_their_flags():
    for command, flags in (("serve", ["--host", "--port", "--api-key", "--served-model-name", "--max-model-len",
                                      "--max-num-seqs", "--max-num-batched-tokens", "--tensor-parallel-size",
                                      "--dtype", "--shutdown-timeout", "--enable-log-requests", "MODEL",
                                      "--max-n", "--max-prompt-chars", "--max-request-body-bytes",
                                      "--trust-request-chat-template", "--allowed-origins", "--allowed-methods",
                                      "--allowed-headers", "--allow-credentials"]),
                           ("chat", ["--url", "--api-key", "--system", "--max-tokens", "--quick", "--model"])):
        out = subprocess.run([sys.executable, "-m", "entrypoints.cli", command, "--help"], capture_output=True, text=True,
                             check=True).stdout
        for flag in flags:
            assert flag in out, (command, flag)


def _read_stream(reply: httpx.Response, sink: list) -> None:
    for line in reply.iter_lines():
        if line.startswith("data: "):
            sink.append(line[6:])


@contextlib.contextmanager
def _serve(model_dir, port: int, log_path: pathlib.Path, *flags: str,
           env: dict | None = None) -> Iterator[subprocess.Popen]:
    """`jvllm serve` of the tiny model in a subprocess, its output in `log_path`; killed if still running. The tests
    pass --no-precompile: notebooks/serving_and_metrics.ipynb starts `jvllm serve` with its default precompile."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "entrypoints.cli", "serve", str(model_dir), "--port", str(port), "--max-num-seqs",
             "8", "--kv-cache-memory-bytes", "64M", "--max-model-len", "512", "--served-model-name", MODEL, *flags],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def test_sigterm_lets_open_streams_finish_then_exits_0(tiny_llama, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with _serve(tiny_llama, port, tmp_path / "serve.log", "--shutdown-timeout", "120", "--disable-access-log",
                "--no-precompile", env={"JVLLM_API_KEY": API_KEY}) as proc:
        assert wait_until(lambda: _healthy(url), timeout=180), (tmp_path / "serve.log").read_text()
        headers = {"Authorization": f"Bearer {API_KEY}"}
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # the env key is in force
        client = httpx.Client(timeout=600)
        streams, sinks, threads = [], [], []
        for i in range(3):
            reply = client.send(client.build_request(
                "POST", f"{url}/v1/completions", headers=headers,
                json={"prompt": f"drain {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}), stream=True)
            assert reply.status_code == 200
            sink: list[str] = []
            thread = threading.Thread(target=_read_stream, args=(reply, sink))
            thread.start()
            streams.append(reply), sinks.append(sink), threads.append(thread)
        assert wait_until(lambda: all(sinks), timeout=300)  # every stream is producing tokens
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: not _accepts(port), timeout=30)  # no new connections once draining
        for thread in threads:
            thread.join(timeout=300)
        for sink in sinks:
            assert sink[-1] == "[DONE]"
            last = json.loads(sink[-2])
            assert last["choices"][0]["finish_reason"] == "length"  # finished, not aborted
        assert proc.wait(timeout=120) == 0
        client.close()


def test_past_the_shutdown_timeout_open_requests_end_cleanly_and_the_server_exits_0(tiny_llama, tmp_path):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    # requests long enough that none can finish inside the 2 s timeout, however fast the tiny model decodes: a copy
    # of the model whose config allows 8192 positions
    long_llama = tmp_path / "long-llama"
    shutil.copytree(tiny_llama, long_llama)
    config = json.loads((long_llama / "config.json").read_text())
    (long_llama / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    with _serve(long_llama, port, log_path, "--shutdown-timeout", "2", "--max-model-len", "8192",
                "--no-precompile") as proc:
        assert wait_until(lambda: _healthy(url), timeout=180), log_path.read_text()
        client = httpx.Client(timeout=600)
        endless = {"prompt": "go on", "max_tokens": 8000, "ignore_eos": True}
        sinks, threads = [], []
        for i in range(4):
            reply = client.send(client.build_request("POST", f"{url}/v1/completions",
                                                     json={**endless, "stream": True}), stream=True)
            sink: list[str] = []
            threads.append(threading.Thread(target=_read_stream, args=(reply, sink)))
            threads[-1].start()
            sinks.append(sink)
        whole: dict = {}
        threads.append(threading.Thread(target=lambda: whole.update(
            reply=httpx.post(f"{url}/v1/completions", json=endless, timeout=600))))
        threads[-1].start()
        assert wait_until(lambda: all(sinks) and _requests_in_engine(url) == 5, timeout=300)
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=120)
        for sink in sinks:  # an error event, then [DONE]: the client knows the stream did not just stop
            assert sink[-1] == "[DONE]"
            assert json.loads(sink[-2])["error"]["code"] == "shutting_down"
        assert whole["reply"].status_code == 503 and whole["reply"].json()["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=60) == 0
        client.close()
    text = log_path.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
    assert "shutdown timeout (2s) reached" in text


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _requests_in_engine(url: str) -> int:
    """Running plus waiting sequences, read from /metrics."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return -1
    counts = re.findall(r'^jvllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.]+)$', text, re.MULTILINE)
    return int(sum(float(count) for count in counts))


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_chat_against_a_running_server_streams_the_reply(live_server, client, capsys, monkeypatch):
    expected = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                              temperature=0, max_tokens=8).choices[0].message.content
    capsys.readouterr()
    code = main(["chat", "--url", live_server.v1, "--api-key", API_KEY, "--quick", "Hello!", "--temperature", "0",
                 "--max-tokens", "8"])
    assert code == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["chat", "--url", live_server.v1, "--quick", "Hello!"]) == 2  # no key: refused, said plainly
    assert "invalid or missing API key" in capsys.readouterr().err


def test_chat_in_process_matches_engine_chat(tiny_llama, offline_engine, capsys):
    from jvllm import SamplingParams

    expected = offline_engine.chat([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
                                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    code = main(["chat", "--model", str(tiny_llama), "--system", "Be kind.", "--quick", "Hi", "--temperature", "0",
                 "--max-tokens", "8", "--kv-cache-memory-bytes", "64M", "--max-model-len", "512",
                 "--no-precompile"])  # in this process, without the persistent cache: shapes compile when met
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == expected + "\n"


def scripted_input(lines: list[str]):
    """A stand-in for input(): the lines one by one, then EOF (Ctrl-D)."""
    feed = iter(lines)

    def read(_prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    return read


@pytest.mark.parametrize("lines, expected", [(["one", "/clear", "two", "/exit"], 2), (["one", "two"], 2)])
def test_the_chat_loop_keeps_the_conversation_until_cleared(lines, expected):
    import asyncio

    from entrypoints.chat_client import converse

    seen: list[list[dict]] = []

    async def reply(messages):
        seen.append([dict(m) for m in messages])
        yield f"echo {messages[-1]['content']}"

    read = scripted_input(lines)

    out: list[str] = []
    asyncio.run(converse(reply, "sys", None, read=read, write=out.append))
    assert len(seen) == expected
    assert "".join(out).startswith("echo one\n")
    if "/clear" in lines:
        assert [m["role"] for m in seen[1]] == ["system", "user"]
    else:
        assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]


def test_ctrl_c_stops_a_reply_and_the_conversation_goes_on(tmp_path):
    """SIGINT during a reply cancels just that reply (its text so far stays in the conversation); /system, /save
    and /reset act on the conversation."""
    import asyncio
    import json
    import os
    import signal

    from entrypoints.chat_client import converse

    seen: list[list[dict]] = []

    async def reply(messages):
        seen.append([dict(m) for m in messages])
        yield "partial"
        if len(seen) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C mid-reply
            await asyncio.sleep(30)
            yield "never shown"
        yield " done"

    saved = tmp_path / "chat.json"
    read = scripted_input(["/system be brief", "one", "two", f"/save {saved}", "/reset", "three"])

    out: list[str] = []
    asyncio.run(asyncio.wait_for(converse(reply, None, None, read=read, write=out.append), 20))
    text = "".join(out)
    assert "partial [stopped]\n" in text and "never shown" not in text
    assert [m["content"] for m in seen[1]] == ["be brief", "one", "partial", "two"]
    assert json.loads(saved.read_text())["messages"][-1] == {"role": "assistant", "content": "partial done"}
    assert [m["content"] for m in seen[2]] == ["be brief", "three"]


def test_in_process_chat_shows_start_up_progress_unless_quiet(caplog, monkeypatch):
    """`jvllm chat` without --url: the engine's phase lines show while it loads, not during the conversation."""
    import logging

    from entrypoints.chat_client import _startup_progress

    monkeypatch.delenv("JVLLM_LOGGING_LEVEL", raising=False)
    logger = logging.getLogger("jvllm")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)  # run_chat's basicConfig level
    caplog.handler.setLevel(logging.NOTSET)
    for show in (True, False):
        with _startup_progress(show):
            logger.info("loading the model (shown=%s)", show)
        logger.info("during the conversation")
    assert [r.getMessage() for r in caplog.records] == ["loading the model (shown=True)"]
