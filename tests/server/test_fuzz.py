"""schemathesis fuzzes every route of a live server from its /openapi.json: no 5xx, responses as documented."""
from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from tests.server.conftest import API_KEY, LogRecords, idle, start_server, wait_until

# cases per route: the CI run's quick pass, and the thorough one (extended)
QUICK, THOROUGH = 10, 120
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance,negative_data_rejection")


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    """Short contexts keep generated requests quick (a request without max_tokens generates to the end of the
    context); the key is required, as on a real deployment."""
    server = start_server(tiny_llama, max_num_seqs=16, kv_cache_memory_bytes=16 << 20, max_model_len=40)
    yield server
    server.stop()


@pytest.mark.parametrize("cases_per_route", [pytest.param(QUICK, id="quick"),
                                             pytest.param(THOROUGH, id="thorough", marks=pytest.mark.extended)])
def test_fuzzed_requests_get_no_5xx_and_documented_responses(fuzz_server, cases_per_route):
    with LogRecords(logging.WARNING) as records:
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{fuzz_server.url}/openapi.json",
             "--max-examples", str(cases_per_route), "--checks", CHECKS, "--seed", "20261123",
             "--header", f"Authorization: Bearer {API_KEY}", "--request-timeout", "120",
             "--phases", "examples,coverage,fuzzing", "--no-color"],
            capture_output=True, text=True, timeout=900)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated and int(generated.group(1)) >= 8 * cases_per_route, report[-2000:]
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    assert wait_until(lambda: idle(fuzz_server.engine), timeout=60)
