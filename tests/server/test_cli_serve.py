"""`jvllm serve` as a real process (SIGTERM drains open streams, exit 0) and `jvllm chat` both ways."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from jvllm.cli import main
from tests.server.conftest import API_KEY, MODEL, wait_until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_and_chat_help_explain_their_flags():
    for command, flags in (("serve", ["--host", "--port", "--api-key", "--served-model-name", "--max-model-len",
                                      "--max-num-seqs", "--max-num-batched-tokens", "--tensor-parallel-size",
                                      "--dtype", "--shutdown-timeout", "--enable-log-requests", "MODEL"]),
                           ("chat", ["--url", "--api-key", "--system", "--max-tokens", "--quick", "--model"])):
        out = subprocess.run([sys.executable, "-m", "jvllm.cli", command, "--help"], capture_output=True, text=True,
                             check=True).stdout
        for flag in flags:
            assert flag in out, (command, flag)


def _read_stream(reply: httpx.Response, sink: list) -> None:
    for line in reply.iter_lines():
        if line.startswith("data: "):
            sink.append(line[6:])


def test_sigterm_lets_open_streams_finish_then_exits_0(tiny_llama, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jvllm.cli", "serve", str(tiny_llama), "--port", str(port), "--max-num-seqs", "8",
         "--kv-cache-memory-bytes", "64M", "--max-model-len", "512", "--served-model-name", MODEL,
         "--shutdown-timeout", "120", "--disable-access-log"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JVLLM_API_KEY": API_KEY})
    url = f"http://127.0.0.1:{port}"
    try:
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
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


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
                 "--max-tokens", "8", "--kv-cache-memory-bytes", "64M", "--max-model-len", "512"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == expected + "\n"


@pytest.mark.parametrize("lines, expected", [(["one", "/clear", "two", "/exit"], 2), (["one", "two"], 2)])
def test_the_chat_loop_keeps_the_conversation_until_cleared(lines, expected):
    import asyncio

    from server.chat_client import converse

    seen: list[list[dict]] = []

    async def reply(messages):
        seen.append([dict(m) for m in messages])
        yield f"echo {messages[-1]['content']}"

    feed = iter(lines)

    def read(_prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out: list[str] = []
    asyncio.run(converse(reply, "sys", None, read=read, write=out.append))
    assert len(seen) == expected
    assert "".join(out).startswith("echo one\n")
    if "/clear" in lines:
        assert [m["role"] for m in seen[1]] == ["system", "user"]
    else:
        assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
