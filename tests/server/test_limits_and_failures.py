"""A one-sequence server: a full waiting queue answers 503 + Retry-After; a dead engine makes /health 503."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server, wait_until


@pytest.fixture(scope="module")
def narrow_server(tiny_llama):
    server = start_server(tiny_llama, max_num_seqs=1, max_waiting_requests=1)
    yield server
    server.stop()


def test_a_full_waiting_queue_is_503_with_retry_after(narrow_server, monkeypatch):
    import time

    runner = narrow_server.engine.engine.runner
    real = runner.collect

    def slow(*args, **kwargs):  # steps of >= 20 ms: the long request surely outlives the test's checks
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "collect", slow)
    long = {"prompt": "busy", "max_tokens": 480, "ignore_eos": True, "stream": True}
    url, headers = f"{narrow_server.v1}/completions", narrow_server.headers
    with httpx.Client(timeout=600) as first, httpx.Client(timeout=600) as second:
        with first.stream("POST", url, headers=headers, json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: dropping a half-read iterator closes the connection
            next(lines)  # it holds the only sequence slot
            with second.stream("POST", url, headers=headers, json=long) as queued:
                assert queued.status_code == 200  # accepted: it waits for the slot
                assert wait_until(lambda: narrow_server.engine.stats.num_waiting == 1)
                refused = httpx.post(url, headers=headers, json={"prompt": "one more", "max_tokens": 2})
                assert refused.status_code == 503
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "queue_full"
    assert wait_until(lambda: narrow_server.engine.stats.num_waiting == 0)
    ok = httpx.post(url, headers=headers, json={"prompt": "room again", "max_tokens": 2}, timeout=600)
    assert ok.status_code == 200


def test_a_dead_engine_makes_health_503_and_requests_503(narrow_server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(narrow_server.engine.engine.runner, "collect", broken)
    url, headers = f"{narrow_server.v1}/completions", narrow_server.headers
    codes = [httpx.post(url, headers=headers, json={"prompt": f"try {i}", "max_tokens": 2}, timeout=600).status_code
             for i in range(3)]
    assert codes == [500, 500, 500]  # three failed steps in a row: the engine gives up
    assert wait_until(lambda: not narrow_server.engine.is_running)
    health = httpx.get(f"{narrow_server.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    after = httpx.post(url, headers=headers, json={"prompt": "anyone?", "max_tokens": 2})
    assert after.status_code == 503
