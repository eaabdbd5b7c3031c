"""Hostile constraints and sizes against a live server: grammars and schemas that crashed the grammar compiler,
huge choice lists, tool lists and tokenizer inputs. Each is a 400 in plain words, or a 200 whose output holds;
after each, the server answers /health and serves a plain request."""
from __future__ import annotations

import dataclasses
import gc
import json
import resource

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.hostile_inputs import lark_chain, schema_ref_chain
from tests.server.conftest import API_KEY, MODEL, idle, start_server, wait_until

INTERNAL_TEXT = ("panic", "backtrace", "<state>", "<non-verbose/>", "Traceback", ".rs:")


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The tiny Llama behind a server whose grammar sandbox has a 1 MiB stack, so that a chain of 500 rules (within
    every size limit) crashes the sandbox as 3,000 crashed a default thread; every other limit is the default."""
    from jvllm.structured.limits import GrammarLimits

    served = start_server(tiny_llama)
    served.engine.engine._grammars.limits = dataclasses.replace(GrammarLimits(), sandbox_stack_bytes=1 << 20)
    yield served
    served.stop()


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=timeout)


def complete(server, constraint: dict | None = None, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 8, "temperature": 1.0, "seed": 1, **fields}
    if constraint is not None:
        body["structured_outputs"] = constraint
    return post(server, "/v1/completions", body)


def refused(response: httpx.Response, *phrases: str, param: str | None = None) -> dict:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    for phrase in phrases:
        assert phrase in error["message"], error
    for internal in INTERNAL_TEXT:
        assert internal not in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def still_serving(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    plain = complete(server)
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length", plain.text[:300]
    assert wait_until(lambda: idle(server.engine), timeout=30)


def test_grammars_that_crashed_the_compiler_are_400s(server):
    refused(complete(server, {"grammar": lark_chain(100_000)}), "structured_outputs.grammar is", "bytes long",
            param="structured_outputs.grammar")
    refused(complete(server, {"grammar": lark_chain(3_000)}), "defines 3002 rules; at most 2000")
    still_serving(server)


def test_a_crash_inside_the_compiler_costs_one_400_and_the_next_grammar_compiles(server):
    error = refused(complete(server, {"grammar": lark_chain(500)}), "structured_outputs.grammar could not be compiled",
                    "the grammar compiler crashed on it (signal SIGSEGV")
    assert error["param"] == "structured_outputs.grammar"
    ok = complete(server, {"grammar": 'start: "yes" | "no"'})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no"), ok.text
    still_serving(server)


def test_a_schema_chaining_a_thousand_refs_is_a_400_in_response_format_and_in_tools(server):
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_ref_chain(1_000)}}}
    refused(post(server, "/v1/chat/completions", body), "response_format.json_schema.schema has 1001 $refs",
            param="response_format")
    tool = {"type": "function", "function": {"name": "f", "parameters": schema_ref_chain(300)}}
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
            "tool_choice": "required"}
    refused(post(server, "/v1/chat/completions", body), "chains $refs", param="tools")
    still_serving(server)


def test_more_tools_than_openai_allows_are_a_400(server):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(129)]
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "tools": tools,
            "tool_choice": "required"}
    refused(post(server, "/v1/chat/completions", body), "tools has 129 functions; at most 128", param="tools")


def test_ten_thousand_choices_give_one_of_them_and_a_hundred_thousand_are_a_quick_400(server):
    choices = [f"option number {i}" for i in range(10_000)]
    for seed in range(3):
        response = complete(server, {"choice": choices}, seed=seed, max_tokens=16)
        assert response.status_code == 200, response.text[:300]
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] in choices, choice
    many = [f"option number {i}" for i in range(100_000)]
    response = complete(server, {"choice": many})
    refused(response, "structured_outputs.choice has 100000 options; at most 10000")
    assert response.elapsed.total_seconds() < 5
    still_serving(server)


def test_a_grammar_that_meets_a_parser_limit_mid_output_fails_instead_of_breaking_its_constraint(server):
    wide = "start: " + " | ".join(json.dumps(f"option number {i}") for i in range(5_000))
    refused(complete(server, {"grammar": wide}, max_tokens=16),
            "the output cannot follow its structured-output constraint", "max is 2000")
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "Answer:", "max_tokens": 16, "stream": True,
                            "structured_outputs": {"grammar": wide}}, timeout=120) as streamed:
        assert streamed.status_code == 200
        events = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "cannot follow" in error["message"] and error["code"] == "generation_failed"
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert "stop" not in finishes  # no chunk passed the broken output off as finished
    still_serving(server)


def test_tokenizer_routes_have_the_completion_size_limits(server):
    limits = server.app.state.jvllm.limits
    refused(post(server, "/tokenize", {"model": MODEL, "prompt": "a" * (limits.max_prompt_chars + 1)}),
            "--max-prompt-chars", param="prompt")
    refused(post(server, "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "a" * (limits.max_prompt_chars + 1)}]}), param="messages")
    refused(post(server, "/detokenize", {"model": MODEL, "tokens": [5] * (limits.max_prompt_tokens + 1)}),
            f"at most {limits.max_prompt_tokens}", param="tokens")
    at_limit = post(server, "/tokenize", {"model": MODEL, "prompt": "hello " * (limits.max_prompt_chars // 6)})
    assert at_limit.status_code == 200 and at_limit.json()["count"] > 1000
    still_serving(server)


def test_memory_settles_after_the_largest_tokenizer_and_grammar_requests(server):
    """The largest inputs every route takes leave resident memory (of this test process, which runs the server)
    near where it was; the grammar sandbox is a separate process."""
    limits = server.app.state.jvllm.limits

    def resident_mb() -> float:
        gc.collect()
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / 2**20

    post(server, "/tokenize", {"model": MODEL, "prompt": "word " * (limits.max_prompt_chars // 5)})  # warm-up
    before = resident_mb()
    for i in range(3):
        assert post(server, "/tokenize", {"model": MODEL, "prompt": f"w{i} " * (limits.max_prompt_chars // 4)}
                    ).status_code == 200
        assert complete(server, {"choice": [f"c{i}-{j}" for j in range(10_000)]}).status_code == 200
        refused(post(server, "/tokenize", {"model": MODEL, "prompt": "x" * (4 * limits.max_prompt_chars)}))
    assert resident_mb() - before < 300


def test_the_heap_is_trimmed_after_a_large_body_only(server, monkeypatch):
    from server import memory_trim

    trims = []
    monkeypatch.setattr(memory_trim, "release_freed_memory", lambda: trims.append(1))
    assert post(server, "/tokenize", {"model": MODEL, "prompt": "small"}).status_code == 200
    assert wait_until(lambda: False, timeout=0.3) is False and trims == []
    refused(post(server, "/tokenize", {"model": MODEL, "prompt": "x" * (memory_trim.TRIM_AFTER_BYTES + 10)}))
    assert wait_until(lambda: trims == [1], timeout=10)


@st.composite
def deep_or_wide_constraint(draw) -> dict:
    """Grammars and schemas deep (chains, nesting, $ref chains) or wide (alternatives, properties, enums)."""
    size = draw(st.integers(1, 6_000))
    kind = draw(st.sampled_from(["chain", "alternatives", "parens", "nested", "properties", "refs", "anyof",
                                 "enum", "regex_alternation", "regex_nesting"]))
    if kind == "chain":
        return {"grammar": lark_chain(size)}
    if kind == "alternatives":
        return {"grammar": "start: " + " | ".join(json.dumps(f"a{i}") for i in range(size))}
    if kind == "parens":
        return {"grammar": "start: " + "(" * size + '"a"' + ")" * size}
    if kind == "regex_alternation":
        return {"regex": "(" + "|".join(f"w{i}" for i in range(size)) + ")"}
    if kind == "regex_nesting":
        return {"regex": "(" * min(size, 3_000) + "a" + ")" * min(size, 3_000)}
    if kind == "nested":
        schema: dict = {"type": "integer"}
        for _ in range(min(size, 400)):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return {"json": schema}
    if kind == "properties":
        return {"json": {"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(size)}}}
    if kind == "refs":
        return {"json": schema_ref_chain(min(size, 1_500))}
    if kind == "anyof":
        return {"json": {"anyOf": [{"const": i} for i in range(size)]}}
    return {"json": {"enum": [f"v{i}" for i in range(size)]}}


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(constraint=deep_or_wide_constraint())
def test_deep_and_wide_constraints_get_a_200_or_a_400_and_the_server_lives(server, constraint):
    response = complete(server, constraint, max_tokens=4)
    assert response.status_code in (200, 400), response.text[:300]
    if response.status_code == 400:
        refused(response)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
