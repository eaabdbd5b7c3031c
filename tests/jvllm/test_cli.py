"""The `jvllm` command line: help text, human-friendly integers, and a real generate run."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys

import pytest

from entrypoints.cli import build_parser, main
from jvllm.engine.arg_utils import EngineArgs, human_int, json_list


def test_human_int_accepts_suffixes():
    assert human_int("512") == 512
    assert human_int("4k") == 4096
    assert human_int("32K") == 32768
    assert human_int("1m") == 1 << 20
    with pytest.raises(argparse.ArgumentTypeError):
        human_int("lots")


def test_cors_flags_take_json_lists_of_strings(capsys):
    assert json_list('["https://a.example", "http://b"]') == ["https://a.example", "http://b"]
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(argparse.ArgumentTypeError):
            json_list(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "*"])
    assert "JSON list" in capsys.readouterr().err


def test_json_object_flags_take_json_objects(capsys):
    args = build_parser().parse_args(["serve", "--limit-mm-per-prompt", '{"image": 2}',
                                      "--mm-processor-kwargs", '{"max_pixels": 802816}'])
    kwargs = vars(EngineArgs.from_cli_args(args))
    assert kwargs["limit_mm_per_prompt"] == {"image": 2} and kwargs["mm_processor_kwargs"] == {"max_pixels": 802816}
    for flag, bad, reason in [("--limit-mm-per-prompt", '{"image": "2"}', "JSON object of integers"),
                              ("--mm-processor-kwargs", "max_pixels=5", "expected a JSON object"),
                              ("--speculative-config", "[4]", "like '{\"method\": \"ngram\"")]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, bad])
        assert reason in capsys.readouterr().err


def test_help_lists_generate_and_its_flags():
    top = subprocess.run([sys.executable, "-m", "entrypoints.cli", "--help"], capture_output=True, text=True, check=True)
    assert "generate" in top.stdout
    sub = subprocess.run([sys.executable, "-m", "entrypoints.cli", "generate", "--help"], capture_output=True, text=True,
                         check=True)
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--chat"):
        assert flag in sub.stdout


def test_the_command_line_parser_loads_no_jax_and_no_web_framework():
    """`jvllm --help` and the flags of every command need neither: each command imports what it runs."""
    probe = ("import sys; from entrypoints.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('jax', 'fastapi', 'transformers', 'flax') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr


def test_the_command_line_silences_transformers_torch_advice(monkeypatch, capsys):
    """jvllm needs no torch: transformers' "PyTorch was not found" advice must not greet a torch-free install."""
    monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", raising=False)
    assert main([]) == 0
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    assert "generate" in capsys.readouterr().out


def test_generate_prints_the_same_completion_as_the_engine(default_engine, capsys, caplog):
    """...having compiled only the shapes its one prompt meets: a 16-token prefill step and one-row decode steps."""
    from jvllm import SamplingParams

    expected = default_engine.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                                       use_tqdm=False)[0].outputs[0].text
    caplog.set_level(logging.INFO, logger="jvllm")
    code = main(["generate", "The capital of France is", "--max-tokens", "8", "--kv-cache-memory-bytes", "64M",
                 "--max-model-len", "2048", "--max-num-seqs", "32", "--dtype", "float32"])
    assert code == 0
    assert capsys.readouterr().out.rstrip("\n") == expected
    assert "precompiled 2 step shapes" in caplog.text
    assert "compiling step shape" not in caplog.text  # nothing compiled after start


def test_generate_reports_a_bad_model_path_without_a_traceback(capsys):
    assert main(["generate", "hi", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err


def test_a_second_generate_loads_every_compiled_piece_from_the_persistent_cache(tiny_model_factory, tmp_path):
    """However quickly a piece compiles, the first start stores it and the next loads it (a compile at every start
    is what a short minimum compile time for the cache costs); the next start also lowers every piece from its
    stored module (jvllm.worker.exported_pieces) instead of tracing it, and completes the prompt the same, as does a
    start with that store turned off."""
    code = ("import collections, sys\n"
            "import jax\n"
            "events = collections.Counter()\n"
            "jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))\n"
            "from jvllm.worker.exported_pieces import ExportedPieces\n"
            "from entrypoints.command import run\n"
            "pieces = []\n"
            "ExportedPieces.__init__ = (lambda init: lambda self, *a: (init(self, *a), pieces.append(self))[0])("
            "ExportedPieces.__init__)\n"
            f"sys.argv = ['jvllm', 'generate', 'Hi', '--model', {str(tiny_model_factory('llama'))!r}, "
            "'--max-tokens', '8', '--kv-cache-memory-bytes', '16M', '--max-model-len', '256', '--dtype', 'float32']\n"
            "code = run()\n"
            "print('requests', events['/jax/compilation_cache/compile_requests_use_cache'], "
            "'hits', events['/jax/compilation_cache/cache_hits'], "
            "'stored', sum(p.stored for p in pieces), 'loaded', sum(p.loaded for p in pieces), "
            "'plain', sum(p.plain for p in pieces))\n"
            "sys.exit(code)\n")
    from cpu_kernels import build

    build.load()  # the session's native kernels, so that the runs below build nothing but XLA's pieces
    shutil.copytree(build.cache_dir(), tmp_path / "cpu_kernels")
    env = {**os.environ, "JVLLM_CACHE_DIR": str(tmp_path)}
    counts, texts = [], []
    for switch in ("1", "1", "0"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**env, "JVLLM_EXPORTED_PIECES": switch}, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        text, counters = run.stdout.rsplit("requests ", 1)
        counts.append(tuple(int(word) for word in counters.split()[0::2]))
        texts.append(text)
    (first_requests, first_hits, *first_pieces), (second_requests, second_hits, *second_pieces), off = counts
    assert first_requests > 0 and first_hits == 0  # a fresh cache: everything compiled, and stored
    assert second_requests == first_requests and second_hits == second_requests
    stored, loaded, plain = first_pieces
    assert stored > 0 and loaded == 0 and plain == 0  # every piece exported, and kept
    assert second_pieces == [0, stored, 0]  # every piece lowered from its stored module
    assert off[2:] == (0, 0, 0)  # turned off: every piece traced
    assert texts[0].strip() and texts[1] == texts[0] and texts[2] == texts[0]
