"""BatchPolicy: batches of several requests speculate while their verifying steps emit more tokens a second than
plain steps, as timed; a lone request always may, a batch past max_batch_size never."""
from __future__ import annotations

from jvllm.spec_decode.batch_policy import EXPLORE_EVERY, MIN_SAMPLES, BatchPolicy


def _run(policy: BatchPolicy, batch: int, steps: int, verify_rate: float, plain_rate: float) -> list[bool]:
    """`steps` steps of `batch` requests, each of the kind the policy picks, timed at the given tokens a second
    (a verifying step emits 3 tokens a request, a plain one 1). -> the kinds picked."""
    picked = []
    for _ in range(steps):
        verifies = policy.speculates(batch)
        tokens = batch * (3 if verifies else 1)
        policy.record(batch, verifies, tokens, tokens / (verify_rate if verifies else plain_rate))
        picked.append(verifies)
    return picked


def test_a_batch_speculates_while_verifying_is_faster_and_stops_when_it_is_not():
    policy = BatchPolicy(max_batch_size=4)
    picked = _run(policy, 3, 64, verify_rate=300.0, plain_rate=200.0)
    assert picked[:2 * MIN_SAMPLES].count(True) == MIN_SAMPLES  # both kinds timed first
    settled = picked[2 * MIN_SAMPLES:]
    assert 1 <= settled.count(False) <= len(settled) // EXPLORE_EVERY + 1  # plain steps only to explore
    # the machine slows verification down: the policy turns to plain steps within a few explorations
    picked = _run(policy, 3, 8 * EXPLORE_EVERY, verify_rate=100.0, plain_rate=200.0)
    assert picked[-4 * EXPLORE_EVERY:].count(True) <= 4
    assert policy.speculates(2)  # another batch size is timed on its own (from its first step)


def test_explores_the_other_kind_now_and_then():
    policy = BatchPolicy(max_batch_size=4)
    picked = _run(policy, 2, 2 * MIN_SAMPLES + 4 * EXPLORE_EVERY, verify_rate=100.0, plain_rate=200.0)
    assert 3 <= picked[2 * MIN_SAMPLES:].count(True) <= 5  # one verifying step every EXPLORE_EVERY


def test_lone_requests_always_and_large_batches_never_untimed_always():
    policy = BatchPolicy(max_batch_size=4)
    _run(policy, 1, 20, verify_rate=1.0, plain_rate=1000.0)
    assert policy.speculates(1) and not policy.speculates(5)
    untimed = BatchPolicy(max_batch_size=4, timed=False)
    assert _run(untimed, 3, 20, verify_rate=1.0, plain_rate=1000.0) == [True] * 20
    assert not untimed.speculates(5)
