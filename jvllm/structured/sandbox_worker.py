"""The grammar sandbox's child process: compiles each constraint before the server does, under a stack, memory
and time budget, so that a crash of the native grammar library costs one refused request instead of the server.

Run as a script (`python -P sandbox_worker.py`) by jvllm.structured.sandbox; it imports only the standard library
and llguidance. Messages both ways are a 4-byte big-endian length and UTF-8 JSON."""
from __future__ import annotations

import json
import os
import resource
import struct
import sys
import threading
from typing import Any, BinaryIO

import llguidance

# Between JSON tokens: at most one line break and an indentation, enough for pretty-printed JSON. Unbounded
# whitespace (JSON's own rule) lets small models loop on newlines until max_tokens, leaving invalid JSON.
# A schema's own "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x09]{0,2}(\x0D?\x0A[\x20\x09]{0,32})?"}
ANY_JSON_OBJECT = {"type": "object"}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def read_message(stream: BinaryIO) -> Any:
    """-> the next message, or None at the end of the stream."""
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack(">I", header)
    body = stream.read(size)
    return None if len(body) < size else json.loads(body)


def encode_message(message: Any) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body


def escape_regex(text: str) -> str:
    """`text` as a literal in llguidance's (Rust) regex syntax."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def grammar_text(kind: str, value: Any) -> str:
    """llguidance's grammar document for one constraint (plain JSON data, as jvllm.structured.limits reads it).
    A choice is one regular expression, an alternation of literals: the lexer takes 10^5 options in stride, while
    as Lark alternatives every option would be a live parser item after a shared prefix."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("(" + "|".join(escape_regex(c) for c in value) + ")")
    if kind == "grammar":
        return llguidance.grammar_from("grammar", value)
    raise ValueError(f"unknown constraint kind {kind!r}")


def compile_constraint(kind: str, value: Any, tokenizer: llguidance.LLTokenizer,
                       limits: llguidance.LLParserLimits) -> dict[str, str]:
    """-> {"grammar": text} when the constraint compiles and yields a first token mask, else {"error": text}."""
    try:
        text = grammar_text(kind, value)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            return {"error": matcher.get_error()}
        return {"grammar": text}
    except (ValueError, TypeError, MemoryError) as error:
        return {"error": str(error) or type(error).__name__}
    except BaseException as error:  # a Rust panic surfaces as pyo3's PanicException (a BaseException)
        return {"error": f"panic: {error}"}


def _cap_memory(extra_bytes: int) -> None:
    """Limit the address space to what the process holds now plus `extra_bytes` (Linux)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[0])
    except OSError:
        return
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_message(stdin)
    if setup is None:
        return
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"] or None)
    limits = llguidance.LLParserLimits(**setup["parser_limits"])
    threading.stack_size(setup["stack_bytes"])  # every compile runs in a fresh thread with exactly this stack
    _cap_memory(setup["memory_bytes"])
    stdout.write(encode_message({"ready": True}))
    stdout.flush()
    while (request := read_message(stdin)) is not None:
        reply: dict[str, str] = {}
        worker = threading.Thread(target=lambda: reply.update(
            compile_constraint(request["kind"], request["value"], tokenizer, limits)))
        worker.start()
        worker.join()
        stdout.write(encode_message(reply or {"error": "the compile thread ended without an answer"}))
        stdout.flush()


if __name__ == "__main__":
    main()
