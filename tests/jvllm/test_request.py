"""Request: the status state machine, finish reasons and the output-length limit (pure Python)."""
from __future__ import annotations

import itertools

import pytest

from jvllm.core.request import Request, RequestStatus
from jvllm.sampling_params import SamplingParams

S = RequestStatus
FINISHED = (S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED, S.FINISHED_ERROR)
LEGAL = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.FINISHED_ABORTED),
    (S.RUNNING, S.PREEMPTED),
    (S.RUNNING, S.FINISHED_STOPPED),
    (S.RUNNING, S.FINISHED_LENGTH),
    (S.RUNNING, S.FINISHED_ABORTED),
    (S.RUNNING, S.FINISHED_ERROR),
    (S.PREEMPTED, S.WAITING),
    (S.PREEMPTED, S.FINISHED_ABORTED),
}
# How to bring a fresh (WAITING) request into each status through legal transitions.
PATHS = {
    S.WAITING: [],
    S.RUNNING: [S.RUNNING],
    S.PREEMPTED: [S.RUNNING, S.PREEMPTED],
    S.FINISHED_STOPPED: [S.RUNNING, S.FINISHED_STOPPED],
    S.FINISHED_LENGTH: [S.RUNNING, S.FINISHED_LENGTH],
    S.FINISHED_ABORTED: [S.FINISHED_ABORTED],
    S.FINISHED_ERROR: [S.RUNNING, S.FINISHED_ERROR],
}


def make_request(prompt_len: int = 5, max_tokens: int | None = 16, max_total: int = 64, rid: str = "r") -> Request:
    return Request(rid, None, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0,
                   max_total_tokens=max_total)


def request_in(status: RequestStatus) -> Request:
    request = make_request()
    for step in PATHS[status]:
        request.set_status(step)
    assert request.status is status
    return request


def test_new_request_is_waiting_with_nothing_computed():
    request = make_request(prompt_len=7)
    assert request.status is S.WAITING
    assert not request.is_finished
    assert request.num_computed_tokens == 0
    assert request.page_table == []
    assert request.num_prompt_tokens == 7 and request.num_tokens == 7
    assert request.finished_time is None
    assert request.group_id == request.request_id


@pytest.mark.parametrize("old,new", sorted(LEGAL, key=lambda t: (t[0].value, t[1].value)),
                         ids=lambda s: s.name)
def test_legal_transitions(old, new):
    request = request_in(old)
    request.set_status(new)
    assert request.status is new
    assert request.is_finished == new.is_finished
    assert (request.finished_time is not None) == new.is_finished


ILLEGAL = sorted(set(itertools.product(S, S)) - LEGAL, key=lambda t: (t[0].value, t[1].value))


@pytest.mark.parametrize("old,new", ILLEGAL, ids=lambda s: s.name)
def test_illegal_transitions_raise_and_leave_status(old, new):
    request = request_in(old)
    with pytest.raises(RuntimeError, match=f"illegal transition {old.name} -> {new.name}"):
        request.set_status(new)
    assert request.status is old


def test_finished_states_are_terminal():
    for end in FINISHED:
        request = request_in(end)
        for target in S:
            with pytest.raises(RuntimeError):
                request.set_status(target)


def test_preemption_round_trip_then_finish():
    request = make_request()
    for status in (S.RUNNING, S.PREEMPTED, S.WAITING, S.RUNNING, S.PREEMPTED, S.WAITING, S.RUNNING,
                   S.FINISHED_LENGTH):
        request.set_status(status)
    assert request.is_finished


@pytest.mark.parametrize("status,reason", [
    (S.WAITING, None), (S.RUNNING, None), (S.PREEMPTED, None),
    (S.FINISHED_STOPPED, "stop"), (S.FINISHED_LENGTH, "length"), (S.FINISHED_ABORTED, "abort"),
    (S.FINISHED_ERROR, "error"),
])
def test_finish_reason_mapping(status, reason):
    assert status.finish_reason == reason
    assert status.is_finished == (reason is not None)


@pytest.mark.parametrize("prompt_len,max_tokens,max_total,expected", [
    (5, 16, 64, 16),  # max_tokens is the limit
    (5, 100, 64, 59),  # max_model_len cuts it
    (5, 59, 64, 59),  # exactly at both limits
    (5, None, 64, 59),  # None = up to max_model_len
    (63, None, 64, 1),
    (63, 16, 64, 1),
    (1, 1, 2, 1),
])
def test_max_output_tokens(prompt_len, max_tokens, max_total, expected):
    request = make_request(prompt_len=prompt_len, max_tokens=max_tokens, max_total=max_total)
    assert request.max_output_tokens == expected


def test_max_output_tokens_does_not_shrink_with_outputs():
    request = make_request(prompt_len=5, max_tokens=None, max_total=20)
    request.output_token_ids += [1, 2, 3]
    assert request.max_output_tokens == 15
    assert request.num_tokens == 8


def test_token_at_spans_prompt_then_output():
    request = make_request(prompt_len=3)
    request.output_token_ids += [7, 8]
    assert [request.token_at(i) for i in range(request.num_tokens)] == [10, 11, 12, 7, 8]
    with pytest.raises(IndexError):
        request.token_at(5)


def test_repr_names_status_and_progress():
    request = make_request(prompt_len=4, rid="abc")
    text = repr(request)
    assert "'abc'" in text and "WAITING" in text and "prompt=4" in text
