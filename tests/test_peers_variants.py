"""benchmarks.peers: which jvllm engines a comparison runs for its KV and batched-weight dtype lists."""
from __future__ import annotations

from benchmarks.peers import jvllm_variants


def test_the_defaults_run_one_engine_named_jvllm():
    assert jvllm_variants("auto", "auto") == [("jvllm", "auto", "auto")]


def test_each_other_dtype_adds_one_engine_on_the_first_of_the_other_list():
    assert jvllm_variants("auto,fp8_e5m2", "none,int8") == [
        ("jvllm", "auto", "none"), ("jvllm kv fp8_e5m2", "fp8_e5m2", "none"), ("jvllm weights int8", "auto", "int8")]
