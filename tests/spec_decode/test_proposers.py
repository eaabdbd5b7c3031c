"""The draft proposers and the config, no model: n-gram lookup, suffix matching, the output cache, parsing, and the
drafter's token buffer."""
from __future__ import annotations

import numpy as np
import pytest

from jvllm import SamplingParams
from jvllm.core.request import Request
from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.drafter import Drafter
from jvllm.spec_decode.ngram import match_lengths, propose_ngram
from jvllm.spec_decode.suffix import MIN_MATCH, SEPARATOR, SHORT_MATCH_MIN_PROB, SHORT_MATCH_SUPPORT, OutputCache, \
    propose_suffix


def _tokens(values: list[int]) -> tuple[np.ndarray, int]:
    buffer = np.zeros(len(values) + 7, np.int32)  # buffers are longer than what is known
    buffer[:len(values)] = values
    return buffer, len(values)


def test_ngram_continues_the_latest_longest_match():
    tokens, n = _tokens([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 1, 2, 3, 4])
    # the tail 2 3 4 occurs twice; with its 1 before it, only at the start: the longest match wins
    assert propose_ngram(tokens, n, min_n=2, max_n=4, limit=3) == [5, 9, 2]
    # up to 3 tokens only: 2 3 4 ends at index 8 (latest), continuing 6 7 8
    assert propose_ngram(tokens, n, min_n=2, max_n=3, limit=3) == [6, 7, 8]
    # past the known end, the repeat (period 7) goes on in the drafts themselves
    assert propose_ngram(tokens, n, min_n=2, max_n=3, limit=10) == [6, 7, 8, 1, 2, 3, 4, 6, 7, 8]


def test_ngram_needs_min_n_tokens_to_match():
    tokens, n = _tokens([5, 6, 7, 1, 2, 3, 9, 3])
    assert propose_ngram(tokens, n, min_n=2, max_n=4, limit=4) == []  # only "3" matches
    assert propose_ngram(tokens, n, min_n=1, max_n=4, limit=2) == [9, 3]
    assert propose_ngram(tokens, n, min_n=1, max_n=4, limit=0) == []


def test_suffix_takes_the_most_frequent_continuation_and_scales_with_the_match():
    cache = OutputCache(max_requests=8)
    for output in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 2, 3, 4, 6], [2, 3, 9]):
        cache.add(output)
    tokens, n = _tokens([8, 8, 2, 3, 4])  # "2 3 4" occurs three times, followed by 5, 6, 6
    assert propose_suffix(tokens, n, cache, limit=8, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1) == [6]
    assert propose_suffix(tokens, n, cache, limit=8, max_depth=24, max_spec_factor=2.0, min_token_prob=0.1) == [6]
    # no continuation crosses the separator after an output
    assert propose_suffix(tokens, n, cache, limit=1, max_depth=24, max_spec_factor=1.0, min_token_prob=0.9) == []


def test_suffix_searches_the_sequence_itself_and_the_cache_forgets_old_outputs():
    cache = OutputCache(max_requests=1)
    cache.add([4, 5, 6, 7])
    cache.add([1, 1])  # pushes the first one out
    tokens, n = _tokens([3, 4, 5])
    assert propose_suffix(tokens, n, cache, limit=4, max_depth=24, max_spec_factor=4.0, min_token_prob=0.1) == []
    tokens, n = _tokens([4, 5, 6, 0, 4, 5])
    assert propose_suffix(tokens, n, cache, limit=4, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1,
                          min_match=2) == [6, 0]
    # by default a match needs 3 tokens
    assert propose_suffix(tokens, n, cache, limit=4, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1) == []
    tokens, n = _tokens([4, 5, 6, 0, 9, 4, 5, 6])
    assert propose_suffix(tokens, n, cache, limit=4, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1) == [0, 9, 4]


def test_suffix_continues_a_repeat_in_the_sequence_past_its_last_token():
    """A loop (the model repeating a line): the nearest occurrence's continuation runs into the sequence's end and
    goes on in the drafts themselves, as far as the match allows."""
    tokens, n = _tokens([1, 2, 3, 4, 9] * 4 + [1, 2])
    cache = OutputCache(max_requests=8)
    assert propose_suffix(tokens, n, cache, limit=12, max_depth=24, max_spec_factor=1.0,
                          min_token_prob=0.1) == [3, 4, 9, 1, 2] * 2 + [3, 4]
    assert propose_suffix(tokens, n, cache, limit=12, max_depth=6, max_spec_factor=1.0,
                          min_token_prob=0.1) == [3, 4, 9, 1, 2, 3]  # a match of 6: 6 drafts


def test_suffix_continues_a_short_match_only_when_its_continuation_is_near_certain():
    tokens, n = _tokens([5, 7])  # "7" alone matches: shorter than MIN_MATCH
    cache = OutputCache(max_requests=8)
    cache.add([1, 7, 8, 9])
    assert propose_suffix(tokens, n, cache, limit=4, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1) == []
    cache.add([2, 7, 8, 9])  # two occurrences, both followed by 8 9: drafted up to the end of the outputs
    assert propose_suffix(tokens, n, cache, limit=4, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1) == [8, 9]
    cache.add([3, 7, 6])  # 8 now follows two of three: not near-certain
    assert propose_suffix(tokens, n, cache, limit=4, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1) == []


def _reference_match_length(corpus: list[int], end: int, context: list[int], max_length: int) -> int:
    length = 1
    while length < min(max_length, len(context)) and end - length >= 0 and corpus[end - length] == context[-1 - length]:
        length += 1
    return length


def _reference_suffix(tokens: list[int], outputs: list[list[int]], limit: int, max_depth: int, factor: float,
                      min_prob: float) -> list[int]:
    """The suffix rules as plain loops over lists: the longest match of the sequence's tail in the cached outputs
    and the sequence, continued by the most frequent next token (ties: the lowest id), drafts written after the
    sequence as they are chosen."""
    if len(tokens) < 2 or limit < 1:
        return []
    corpus = [t for output in outputs for t in output + [SEPARATOR]] + ([SEPARATOR] if outputs else []) + tokens
    known = len(corpus)
    context = tokens[-max_depth:]
    ends = [i for i in range(known - 1) if corpus[i] == context[-1]]
    if not ends:
        return []
    lengths = [_reference_match_length(corpus, end, context, max_depth) for end in ends]
    best = max(lengths)
    candidates = [end + 1 for end, length in zip(ends, lengths) if length == best]
    if best >= MIN_MATCH:
        wanted, support = min(limit, max(1, int(factor * best))), 1
    else:
        wanted, support, min_prob = limit, SHORT_MATCH_SUPPORT, SHORT_MATCH_MIN_PROB
    corpus += [SEPARATOR] * wanted
    drafts: list[int] = []
    probability = 1.0
    while len(drafts) < wanted:
        candidates = [c for c in candidates if c < known + len(drafts)]
        following = [corpus[c] for c in candidates if corpus[c] != SEPARATOR]
        if len(following) < support:
            break
        token = min(set(following), key=lambda t: (-following.count(t), t))
        probability *= following.count(token) / len(candidates)
        if probability < min_prob:
            break
        corpus[known + len(drafts)] = token
        drafts.append(token)
        candidates = [c + 1 for c in candidates if corpus[c] == token]
    return drafts


def test_proposers_match_plain_loop_references_on_random_sequences():
    """match_lengths and propose_suffix (vectorised scans, counts in Python for few occurrences) against the same
    rules as plain loops: small vocabularies (many ties and partial matches), copied spans, empty and full caches."""
    rng = np.random.default_rng(0)
    for trial in range(400):
        vocab = int(rng.choice([2, 4, 30]))
        outputs = [rng.integers(0, vocab, int(rng.integers(0, 40))).tolist() for _ in range(int(rng.integers(0, 6)))]
        cache = OutputCache(max_requests=8)
        for output in outputs:
            cache.add(output)
        kept = [output for output in outputs if len(output) > 1]
        values = rng.integers(0, vocab, int(rng.integers(1, 120))).tolist()
        if len(values) > 30 and rng.random() < 0.5:  # the tail repeats an earlier span
            start = int(rng.integers(0, len(values) - 20))
            values[-12:] = values[start:start + 12]
        tokens, n = _tokens(values)
        limit, depth = int(rng.integers(0, 12)), int(rng.choice([2, 5, 24]))
        factor, prob = float(rng.choice([0.5, 1.0, 3.0])), float(rng.choice([0.0, 0.1, 0.5]))
        assert propose_suffix(tokens, n, cache, limit, depth, factor, prob) == \
            _reference_suffix(values, kept, limit, depth, factor, prob), trial
        context = np.asarray(values[-depth:], np.int32)
        ends = np.flatnonzero(tokens[:n - 1] == context[-1])
        assert match_lengths(tokens, ends, context, depth).tolist() == \
            [_reference_match_length(values, int(end), context.tolist(), depth) for end in ends], trial


def test_config_parses_vllm_spellings_and_refuses_the_rest():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 4, 4)
    # vLLM's rules: neither given, both 5; one given, the other takes its value
    lookups = [(c.prompt_lookup_min, c.prompt_lookup_max) for c in (
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}),
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}),
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 7}))]
    assert lookups == [(5, 5), (2, 2), (2, 7)]
    suffix = SpeculativeConfig.parse({"method": "suffix"})
    assert (suffix.num_speculative_tokens, suffix.suffix_decoding_max_tree_depth) == (31, 32)
    assert SpeculativeConfig.parse(None) is None
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "small", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "small", 3)
    for bad, words in (({"method": "eagle", "num_speculative_tokens": 2}, "not supported yet"),
                       ({"method": "nrgam"}, "must be one of ngram, suffix, draft_model, got 'nrgam'"),
                       ({"num_speculative_tokens": 2}, "needs a 'method'"),
                       ({"method": "ngram"}, "needs num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6,
                         "prompt_lookup_max": 3}, "larger than"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
                       ({"method": "draft_model", "model": "small"}, "needs num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "model": "small"}, "takes one only then"),
                       ("not json", "JSON object")):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 8},
                                  {"method": "suffix", "suffix_decoding_max_tree_depth": 8}], ids=["ngram", "suffix"])
def test_the_drafter_proposes_from_every_token_when_its_buffer_grows(spec):
    """A request that gains more tokens than its buffer held (a verification step accepting many drafts) is proposed
    for from all of them, also on the call that grows the buffer: the proposers must see the grown buffer (the old
    one lacks the new tokens, and past a long jump the suffix's matched context would be empty)."""
    config = SpeculativeConfig.parse(spec)
    drafter = Drafter(config)
    pattern = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    request = Request("r", None, [1, 2, 3], SamplingParams(temperature=0, max_tokens=400), 0, 1 << 30)
    request.output_token_ids.append(11)
    drafter.propose(request, 8)  # the request's buffer: 64 tokens
    request.output_token_ids += pattern[1:] + pattern * 5  # 63 tokens
    drafter.propose(request, 8)
    request.output_token_ids += pattern * 5 + [11, 12]  # 115 tokens: the buffer grows by more than a match's depth
    known = np.asarray(request.prompt_token_ids + request.output_token_ids, np.int32)
    if config.method == "ngram":
        expected = propose_ngram(known, len(known), config.prompt_lookup_min, config.prompt_lookup_max, 8)
    else:
        expected = propose_suffix(known, len(known), OutputCache(1), 8, config.suffix_decoding_max_tree_depth,
                                  config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    assert expected == [13, 14, 15, 16, 17, 18, 19, 20]
    assert drafter.propose(request, 8).token_ids == tuple(expected)
    assert drafter.has_proposal(request)
