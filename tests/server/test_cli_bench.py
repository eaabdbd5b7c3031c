"""`jvllm bench`: the datasets, offline throughput and latency on a tiny model, `bench serve` against a live server
(and against no server: failures are counted, nothing hangs), `bench startup` on `jvllm serve`."""
from __future__ import annotations

import json
import types

import pytest

from entrypoints.bench.datasets import build_requests
from entrypoints.cli import main
from tests.server.conftest import API_KEY


def _args(**overrides) -> types.SimpleNamespace:
    base = dict(dataset_name="random", dataset_path=None, num_prompts=5, input_len=7, output_len=None,
                prefix_repetition_prefix_len=6, prefix_repetition_suffix_len=3, prefix_repetition_num_prefixes=2,
                seed=0)
    return types.SimpleNamespace(**{**base, **overrides})


class _Words:
    """A tokenizer of whitespace words (one id per word), enough for the ShareGPT reader."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


def test_random_and_prefix_repetition_prompts():
    random = build_requests(_args(), _Words(), vocab_size=1000)
    assert [len(r.prompt_ids) for r in random] == [7] * 5 and {r.output_len for r in random} == {128}
    assert all(100 <= token < 900 for r in random for token in r.prompt_ids)
    shared = build_requests(_args(dataset_name="prefix-repetition", output_len=9), _Words(), vocab_size=1000)
    assert [len(r.prompt_ids) for r in shared] == [9] * 5 and {r.output_len for r in shared} == {9}
    assert shared[0].prompt_ids[:6] == shared[2].prompt_ids[:6] != shared[1].prompt_ids[:6]


def test_sharegpt_file_takes_first_turns_and_skips_what_it_cannot_use(tmp_path):
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "one two three four five"},
                           {"from": "gpt", "value": "a b c d e f"}]},
        {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a b c d"}]},
        {"id": "no conversations"},
        {"conversations": [{"from": "human", "value": "six seven eight nine"},
                           {"from": "gpt", "value": "g h i j k"}, {"from": "human", "value": "more"}]}]))
    requests = build_requests(_args(dataset_name="sharegpt", dataset_path=str(path)), _Words(), vocab_size=1000)
    assert [(len(r.prompt_ids), r.output_len) for r in requests] == [(5, 6), (4, 5)]
    path.write_text("[]")
    with pytest.raises(ValueError, match="no usable conversations"):
        build_requests(_args(dataset_name="sharegpt", dataset_path=str(path)), _Words(), vocab_size=1000)


def test_throughput_and_latency_write_their_results(tiny_llama, tmp_path, capsys):
    engine = ["--model", str(tiny_llama), "--dtype", "float32", "--max-model-len", "128", "--no-precompile",
              "--kv-cache-memory-bytes", str(8 << 20)]
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--num-prompts", "6", "--input-len", "9", "--output-len", "5",
                 "--disable-tqdm", "--output-json", str(out), *engine]) == 0
    results = json.loads(out.read_text())
    assert (results["num_requests"], results["total_output_tokens"], results["total_num_tokens"]) == (6, 30, 84)
    assert results["output_tokens_per_second"] > 0
    assert "Throughput:" in capsys.readouterr().out
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--batch-size", "3", "--input-len", "5", "--output-len", "4",
                 "--num-iters-warmup", "1", "--num-iters", "2", "--output-json", str(out), *engine]) == 0
    results = json.loads(out.read_text())
    assert len(results["latencies"]) == 2 and results["avg_latency"] > 0 and set(results["percentiles"]) >= {"50", "99"}


def test_serve_streams_to_a_live_server_and_reports_percentiles(live_server, tiny_llama, tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", live_server.url, "--api-key", API_KEY, "--tokenizer",
                 str(tiny_llama), "--num-prompts", "8", "--input-len", "6", "--output-len", "5", "--request-rate",
                 "50", "--max-concurrency", "4", "--disable-tqdm", "--result-dir", str(tmp_path),
                 "--result-filename", "serve.json"]) == 0
    results = json.loads((tmp_path / "serve.json").read_text())
    assert (results["completed"], results["failed"], results["total_output_tokens"]) == (8, 0, 40)
    assert 0 < results["median_ttft_ms"] <= results["p99_ttft_ms"]
    assert results["mean_tpot_ms"] > 0 and results["mean_itl_ms"] > 0 and results["mean_e2el_ms"] > 0
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_serve_without_a_server_counts_failures(tiny_llama, tmp_path):
    args = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tiny_llama),
            "--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--disable-tqdm",
            "--result-dir", str(tmp_path), "--result-filename", "none.json"]
    assert main(args) == 1
    results = json.loads((tmp_path / "none.json").read_text())
    assert (results["completed"], results["failed"]) == (0, 3) and results["errors"]


def test_startup_times_jvllm_serve(tiny_llama, tmp_path):
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--num-runs", "1", "--output-json", str(out), "--", "--model", str(tiny_llama),
                 "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
                 "--kv-cache-memory-bytes", str(8 << 20)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert 0 < run["seconds_to_healthy"] <= run["seconds_to_first_token"]
    assert any("KV pool" in line for line in run["log"])
