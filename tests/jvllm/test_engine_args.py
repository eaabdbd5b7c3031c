"""EngineArgs is the one source of the engine's options: every field is an `Engine` keyword and a CLI flag."""
from __future__ import annotations

import dataclasses

import pytest

from entrypoints.cli import build_parser
from jvllm.engine.arg_utils import (MULTIHOST_FIELDS, EngineArgs, add_dataclass_flags, dataclass_from_flags,
                                    option)
from server.settings import ServerSettings


def _flags(command: str) -> set[str]:
    """The option strings of a subcommand's parser."""
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    return {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_every_engine_option_has_a_flag(command):
    fields = [field.name for field in dataclasses.fields(EngineArgs)]
    expected = [name for name in fields if command != "chat" or name not in MULTIHOST_FIELDS]
    missing = [name for name in expected if _flag(name) not in _flags(command)]
    assert not missing, f"EngineArgs fields without a `jvllm {command}` flag: {missing}"
    assert len(fields) >= 31  # every option of Engine, pooling and multi-host ones included


def test_every_server_option_has_a_serve_flag():
    flagged = [field.name for field in dataclasses.fields(ServerSettings) if "flag" in field.metadata]
    assert {"host", "port", "api_key", "max_waiting_requests", "tool_call_parser"} <= set(flagged)
    assert [name for name in flagged if _flag(name) not in _flags("serve")] == []


def test_flag_defaults_are_the_dataclass_defaults(monkeypatch):
    monkeypatch.delenv("JVLLM_API_KEY", raising=False)
    assert EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hi"])) == EngineArgs()
    args = build_parser().parse_args(["serve"])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert dataclass_from_flags(ServerSettings, args, served_model_names=[]) == ServerSettings([])


def test_flags_reach_the_fields():
    args = build_parser().parse_args(["serve", "m.gguf", "--no-async-scheduling", "-tp", "2", "--max-num-seqs", "1k",
                                      "--served-model-name", "a", "b", "--pooling", "mean", "--num-hosts", "2",
                                      "--tensor-parallel-size", "4", "--port", "9000", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"])
    engine = EngineArgs.from_cli_args(args, pooling=None)
    assert (engine.async_scheduling, engine.tensor_parallel_size, engine.max_num_seqs) == (False, 4, 1024)
    assert engine.served_model_names == ["a", "b"] and engine.num_hosts == 2
    settings = dataclass_from_flags(ServerSettings, args, served_model_names=engine.served_model_names)
    assert (settings.port, settings.auto_tool_parser().__class__.__name__) == (9000, "HermesParser")
    assert EngineArgs(served_model_name=["only"]).served_model_name == "only"


@pytest.mark.parametrize("keywords, message", [
    ({"block_size": 24}, "block_size must be a power of two"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
    ({"max_model_len": True}, "max_model_len must be a positive integer"),
    ({"kv_cache_memory_bytes": 1.5}, "kv_cache_memory_bytes must be a positive integer"),
    ({"pooling": "mean", "tensor_parallel_size": 2}, "runs on one device"),
    ({"reasoning_parser": "o1"}, "unknown reasoning parser 'o1'"),
])
def test_options_are_checked_once_in_engine_args(keywords, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**keywords)


def test_an_unknown_engine_keyword_is_refused_before_any_loading():
    from jvllm import Engine

    with pytest.raises(TypeError, match="max_num_sequences"):
        Engine(max_num_sequences=4)
    assert "max_num_seqs (int | None, default None)" in Engine.__init__.__doc__


def test_a_new_field_is_a_new_flag():
    @dataclasses.dataclass
    class Options:
        speculative_tokens: int = option(0, "draft tokens per step", parse=int)
        fast: bool = option(True, "go fast")

    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Options)
    assert dataclass_from_flags(Options, parser.parse_args(["--speculative-tokens", "3", "--no-fast"])) == \
        Options(speculative_tokens=3, fast=False)


def test_a_server_on_cpu_runs_fewer_sequences_by_default_as_vllms(monkeypatch):
    from jvllm.config import UsageContext, default_max_num_seqs
    from jvllm.engine.llm import Engine
    from server.serve import run_server

    assert default_max_num_seqs(True, UsageContext.LLM_CLASS) == 256
    assert default_max_num_seqs(True, UsageContext.OPENAI_API_SERVER) == 128
    assert default_max_num_seqs(False, UsageContext.OPENAI_API_SERVER) == 256
    seen = []

    def capture(cls, args, usage_context=UsageContext.LLM_CLASS):
        seen.append((args, usage_context))
        raise ValueError("stop here")

    monkeypatch.setattr(Engine, "from_engine_args", classmethod(capture))
    with pytest.raises(ValueError, match="stop here"):
        run_server(EngineArgs(max_num_seqs=None), ServerSettings([]))
    assert seen == [(EngineArgs(), UsageContext.OPENAI_API_SERVER)]
