"""Speculative decoding's counters on /metrics, as vLLM names them (with the jvllm: prefix)."""
from __future__ import annotations

import types

from prometheus_client import CollectorRegistry, generate_latest

from jvllm.engine.status import EngineStats
from server.metrics import _EngineStateCollector


def _scrape(stats: EngineStats) -> str:
    registry = CollectorRegistry()
    registry.register(_EngineStateCollector(types.SimpleNamespace(stats=stats), "m"))
    return generate_latest(registry).decode()


def test_counters_rate_and_positions_are_exported():
    text = _scrape(EngineStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40,
                               spec_decode_num_accepted_tokens=25, spec_decode_accepted_per_position=(9, 8, 5, 3)))
    assert 'jvllm:spec_decode_num_drafts_total{model_name="m"} 10.0' in text
    assert 'jvllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0' in text
    assert 'jvllm:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0' in text
    assert 'jvllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 5.0' in text
    assert 'jvllm:spec_decode_acceptance_rate{model_name="m"} 0.625' in text
    assert 'jvllm:spec_decode_mean_accepted_length{model_name="m"} 3.5' in text


def test_an_engine_without_speculation_exports_none():
    assert "spec_decode" not in _scrape(EngineStats())
