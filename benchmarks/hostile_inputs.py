"""Hostile inputs against a real `jvllm serve` (the default model): grammars and schemas that crashed the grammar
compiler, huge choice lists, huge tokenizer inputs; then the image loader on loopback URLs, redirects and an image
bomb. Prints each case's status, time and the server's memory (resident and peak, and the grammar sandbox's), and
asserts the targets: no crash, every answer a 4xx or a 200 whose output holds, peak memory up by < 1 GB and no
growth on a second pass, /health answering throughout, no loopback fetch.
Not part of CI: `python -m benchmarks.hostile_inputs --json out.json`.
"""
from __future__ import annotations

import argparse
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from benchmarks.common import command_line, write_json
from benchmarks.soak import _free_port

KEY = "hostile-key"


def _status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak resident) of a process, MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) / 1024
    return values


def _children(pid: int) -> list[int]:
    """Child processes started by any of the process's threads (the grammar sandbox's is a worker thread's)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                children += [int(child) for child in listing.read().split()]
        except OSError:
            pass
    return children


def lark_chain(rules: int) -> str:
    """r0 -> "x" r1 -> ...: each rule refers to the next, the shape that overflowed the grammar compiler's stack."""
    return "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(rules)) + f'\nr{rules}: "y"\n'


def schema_ref_chain(length: int) -> dict:
    """A JSON schema whose definitions each hold an object property referring to the next: `length` + 1 $refs."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(length)}
    defs[f"d{length}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def http_cases() -> list[tuple[str, str, dict, object]]:
    """(name, path, body, check of a 200's JSON or None when a 4xx is expected)."""
    choices = [f"option number {i}" for i in range(10_000)]
    completion = {"prompt": "Pick one:", "max_tokens": 16, "temperature": 1.0}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    return [
        ("grammar: 10^5 chained rules", "/v1/completions",
         {**completion, "structured_outputs": {"grammar": lark_chain(100_000)}}, None),
        ("grammar: 3,000 chained rules", "/v1/completions",
         {**completion, "structured_outputs": {"grammar": lark_chain(3_000)}}, None),
        ("grammar: 2,000 chained rules (within limits)", "/v1/completions",
         {**completion, "max_tokens": 4, "structured_outputs": {"grammar": lark_chain(1_998)}},
         lambda reply: set(reply["choices"][0]["text"]) <= {"x"}),
        ("response_format: $defs chain of 1,000 $refs", "/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": schema_ref_chain(999)}}},
         None),
        ("tools: parameters with a $defs chain of 600", "/v1/chat/completions",
         {**chat, "tool_choice": "required",
          "tools": [{"type": "function", "function": {"name": "f", "parameters": schema_ref_chain(600)}}]}, None),
        ("choice: 10^4 options", "/v1/completions", {**completion, "structured_outputs": {"choice": choices}},
         lambda reply: reply["choices"][0]["text"] in choices and reply["choices"][0]["finish_reason"] == "stop"),
        ("choice: 10^5 options", "/v1/completions",
         {**completion, "structured_outputs": {"choice": [f"option number {i}" for i in range(100_000)]}}, None),
        ("grammar: 10^4 alternatives", "/v1/completions",
         {**completion, "structured_outputs": {"grammar": "start: " + " | ".join(json.dumps(c) for c in choices)}},
         None),
        ("/tokenize: 31 MB prompt", "/tokenize", {"prompt": "lorem ipsum " * (31_000_000 // 12)}, None),
        ("/tokenize: 5 MB prompt", "/tokenize", {"prompt": "lorem ipsum " * (5_000_000 // 12)}, None),
        ("/tokenize: 650 KB prompt (the limit)", "/tokenize", {"prompt": "lorem ipsum " * (650_000 // 12)},
         lambda reply: reply["count"] > 100_000),
        ("/detokenize: 10^6 ids", "/detokenize", {"tokens": [42] * 1_000_000}, None),
    ]


class _HealthProbe(threading.Thread):
    """GET /health every 50 ms; keeps the slowest answer and any failure."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.slowest, self.failures, self.stopped = url, 0.0, 0, threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            started = time.perf_counter()
            try:
                ok = httpx.get(f"{self.url}/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.failures += not ok
            self.slowest = max(self.slowest, time.perf_counter() - started)
            time.sleep(0.05)


def run_http_cases(url: str, pid: int) -> tuple[list[dict], float]:
    """-> one row per case, and the server's peak resident MiB before the first."""
    baseline = _status(pid)["VmHWM"]
    rows = []
    for name, path, body, check in http_cases():
        probe = _HealthProbe(url)
        probe.start()
        started = time.perf_counter()
        try:
            response = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
            status, reply = response.status_code, response.json()
        except httpx.HTTPError as error:
            status, reply = 0, {"error": {"message": f"no answer: {error}"}}
        seconds = time.perf_counter() - started
        probe.stopped.set()
        probe.join()
        alive = os.path.exists(f"/proc/{pid}") and _status(pid)
        holds = check(reply) if status == 200 and check is not None else None
        message = reply.get("error", {}).get("message", "") if isinstance(reply, dict) else ""
        sandbox = [_status(child) for child in _children(pid)]
        rows.append(dict(case=name, status=status, seconds=round(seconds, 2), output_holds=holds,
                         message=message[:160], health_slowest_s=round(probe.slowest, 3),
                         health_failures=probe.failures, server_rss_mib=round(alive["VmRSS"]) if alive else None,
                         server_peak_mib=round(alive["VmHWM"]) if alive else None,
                         sandbox_rss_mib=[round(s["VmRSS"]) for s in sandbox]))
        print(f"{name:45s} {status:3d} {seconds:6.2f}s health<={probe.slowest:.2f}s "
              f"rss={rows[-1]['server_rss_mib']} peak={rows[-1]['server_peak_mib']} MiB {message[:90]}", flush=True)
        if not alive:
            break
    return rows, baseline


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:
        _Recorder.hits.append(self.path)
        self.send_response(302 if self.path.startswith("/redirect") else 200)
        self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def media_cases() -> list[dict]:
    """The image loader with the server's defaults: loopback URLs, redirects to loopback, an image bomb."""
    from PIL import Image

    from jvllm.multimodal.media import MediaLoader

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    bomb = io.BytesIO()
    Image.new("1", (8000, 8000)).save(bomb, format="PNG")
    import base64

    bomb_url = "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode()
    loader, rows = MediaLoader(), []
    for name, url in [("loopback URL", f"http://127.0.0.1:{port}/internal-admin"),
                      ("localhost name", f"http://localhost:{port}/internal-admin"),
                      ("IPv4-mapped loopback", f"http://[::ffff:127.0.0.1]:{port}/x"),
                      ("cloud metadata address", "http://169.254.169.254/latest/meta-data/"),
                      (f"8000 x 8000 PNG ({len(bomb.getvalue()) // 1024} KB)", bomb_url)]:
        try:
            loader.load_image(url)
            outcome = "fetched"
        except ValueError as error:
            outcome = f"refused: {error}"
        rows.append(dict(case=name, outcome=outcome[:200]))
        print(f"{name:45s} {outcome[:120]}", flush=True)
    unasked = list(_Recorder.hits)  # what the default loader reached: must stay empty
    allowed = MediaLoader(allowed_media_domains=["127.0.0.1"])  # an allowed host that redirects to metadata
    try:
        allowed.load_image(f"http://127.0.0.1:{port}/redirect")
        outcome = "fetched"
    except ValueError as error:
        outcome = f"refused: {error}"
    rows.append(dict(case="allowed host redirecting to 169.254.169.254", outcome=outcome[:200]))
    print(f"{'allowed host redirecting to 169.254.169.254':45s} {outcome[:120]}", flush=True)
    rows.append(dict(case="requests the loopback server saw", outcome=str(_Recorder.hits)))
    rows.append(dict(case="of them, from the default loader", outcome=str(unasked)))
    httpd.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    server = subprocess.Popen([sys.executable, "-m", "entrypoints.cli", "serve", "--port", str(port),
                               "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        rows, baseline = run_http_cases(url, server.pid)
        after_first = _status(server.pid)
        print("second pass (caches warm): resident memory must not grow again", flush=True)
        again, _ = run_http_cases(url, server.pid)
        final = _status(server.pid)
        media = media_cases()
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    log.seek(0)
    text = log.read()
    results = dict(command=command_line("benchmarks.hostile_inputs", argv), cases=rows, media=media,
                   second_pass=again, server_peak_before_mib=round(baseline),
                   server_rss_after_first_pass_mib=round(after_first["VmRSS"]),
                   server_peak_after_mib=round(final["VmHWM"]), server_rss_after_mib=round(final["VmRSS"]),
                   exit_code=exit_code,
                   tracebacks_in_log=text.count("Traceback"))
    print(json.dumps({k: v for k, v in results.items() if k not in ("cases", "second_pass", "media")}, indent=1))
    write_json(args.json, results)
    assert all(row["status"] in (200, 400, 413) for row in rows + again), "a case crashed the server or got a 5xx"
    assert all(row["output_holds"] is not False for row in rows + again), "a 200 broke its constraint"
    assert final["VmRSS"] - after_first["VmRSS"] < 64, "resident memory grew again on the second pass"
    assert final["VmHWM"] - baseline < 1024, "peak memory rose by more than 1 GB"
    assert media[-1]["outcome"] == "[]", "the default loader fetched a loopback URL"
    assert all(row["outcome"].startswith("refused") for row in media[:-2]), "an unsafe image was accepted"
    assert exit_code == 0 and results["tracebacks_in_log"] == 0


if __name__ == "__main__":
    main()
