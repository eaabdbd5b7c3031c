"""The offline replay of speculative decoding (benchmarks.spec_replay): every output token is emitted by exactly one
step, copied outputs verify drafts and cost fewer steps, outputs that copy nothing cost what they cost without, and
verification steps cost what the table of costs by token rows says when one is given."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.spec_replay import StepCosts, parse_row_costs, replay_request
from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.drafter import Drafter

COSTS = StepCosts(prefill_per_token=0.0)


def _drafter() -> Drafter:
    return Drafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4}))


def test_a_copied_output_verifies_drafts_and_every_token_is_emitted_once():
    prompt = list(range(100, 160))
    output = list(range(120, 160)) + [7]
    drafter = _drafter()
    got = replay_request(drafter, "r", prompt, output, COSTS)
    stats = drafter.stats
    assert got.verify == stats.num_drafts > 0
    assert 1 + got.look_ahead + got.fresh + got.verify + stats.num_accepted_tokens == len(output)
    assert got.decode_cost < 0.5 * (len(output) - 1)  # without drafts: one look-ahead step a token


def test_an_output_that_copies_nothing_runs_look_ahead_steps():
    prompt = list(range(100, 160))
    output = list(range(1000, 1040))
    got = replay_request(_drafter(), "r", prompt, output, COSTS)
    assert (got.verify, got.fresh, got.look_ahead) == (0, 0, len(output) - 1)
    assert got.cost == len(output) - 1


def test_drafts_fit_the_step_rows_as_the_engine_schedules_them():
    """A long copy with suffix decoding (up to 31 drafts by default): each verification step holds at most the
    drafter's step rows, the known token included, as the engine's scheduler gives a lone request."""
    prompt = list(range(100, 200))
    output = list(range(100, 180)) + [7]
    for step_rows in (8, 16):
        drafter = Drafter(SpeculativeConfig.parse({"method": "suffix"}), max_step_rows=step_rows)
        drafted = []
        record = drafter.record
        drafter.record = lambda request, count, accepted: (drafted.append(count), record(request, count, accepted))
        got = replay_request(drafter, "r", prompt, output, COSTS)
        assert got.verify == len(drafted) > 0
        assert max(drafted) == step_rows - 1


def test_row_costs_replace_the_linear_model_between_the_rows_given():
    costs = StepCosts(row_costs=parse_row_costs("2:1.2,8:2.0,9:2.6,32:4.6"))
    assert costs.verify(0) == 1.0  # a lone token row: one step
    assert costs.verify(1) == 1.2
    assert abs(costs.verify(4) - 1.6) < 1e-9  # 5 rows: halfway between 2 and 8
    assert costs.verify(8) == 2.6 and costs.verify(31) == 4.6
    assert StepCosts().verify(5) == StepCosts().verify_base + 5 * StepCosts().verify_per_draft
    for bad in ("1:1.0", "4:1.5,3:1.2", "2-1.2", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_row_costs(bad)


def test_the_benchmark_prompts_are_read_from_their_file():
    from benchmarks.spec_decode import prompts

    kinds = prompts()
    assert list(kinds) == ["code edit", "quote summary", "json extraction", "free-form chat"]
    for warm, measured in kinds.values():
        assert len(warm) == 1 and len(measured) == 6
        assert len(set(warm + measured)) == 7 and all(isinstance(text, str) and len(text) > 40 for text in warm + measured)
    assert all(text.startswith("Add a docstring") for text in kinds["code edit"][1])
