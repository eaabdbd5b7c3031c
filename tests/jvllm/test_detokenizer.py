"""Tests for IncrementalDetokenizer against a tiny offline-trained byte-level BPE tokenizer."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jvllm.engine.detokenizer import IncrementalDetokenizer
from jvllm.sampling_params import SamplingParams

_WORDS = [
    "hello", "world", "the", "end", "stop", "STOP", "café", "naïve", "über", "résumé",
    "ñandú", "straße", "Ωmega", "日本語", "中文字符", "東京", "😀", "🎉👍", "😀😀", "a\nb",
]
_SPECIALS = ["<|eos|>", "<|sp|>"]
_ADDED = "<added>"  # a non-special added token: survives skip_special_tokens


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable-char map that ByteLevel tokens are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@functools.lru_cache(maxsize=1)
def _tokenizer() -> PreTrainedTokenizerFast:
    rng = random.Random(1234)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 8))) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=_SPECIALS, show_progress=False,
        # Every byte gets its own token, so any byte string is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(_ADDED, special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _tokenizer()


def _byte_ids(text: str) -> list[int]:
    """One token per UTF-8 byte: splits every multi-byte character across tokens."""
    tk = _tokenizer()
    b2u = _bytes_to_unicode()
    return [tk.convert_tokens_to_ids(b2u[b]) for b in text.encode("utf-8")]


def _full(tk: PreTrainedTokenizerFast, ids: list[int], skip: bool = True) -> str:
    return tk.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _detok(tk: PreTrainedTokenizerFast, **kwargs: object) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tk, [5, 6, 7], SamplingParams(**kwargs))


# Token sequences mixing natural encodings, byte-split text, random ids and specials.
_piece = st.one_of(
    st.lists(st.sampled_from(_WORDS), min_size=1, max_size=3).map(lambda ws: _tokenizer().encode(" ".join(ws))),
    st.sampled_from(_WORDS).map(_byte_ids),
    st.lists(st.integers(0, len(_tokenizer()) - 1), min_size=1, max_size=4),
    st.sampled_from(_SPECIALS + [_ADDED]).map(lambda t: [_tokenizer().convert_tokens_to_ids(t)]),
    st.sampled_from(_WORDS).map(lambda w: _byte_ids(w)[1:]),  # starts with orphan continuation bytes
)
_token_seqs = st.lists(_piece, max_size=12).map(lambda ps: [t for p in ps for t in p])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=_token_seqs, skip=st.booleans(), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_incremental_text_equals_full_decode(ids: list[int], skip: bool, chunks: list[int]) -> None:
    tk = _tokenizer()
    det = _detok(tk, skip_special_tokens=skip)
    i, c = 0, 0
    while i < len(ids):
        n = chunks[c % len(chunks)]
        c += 1
        assert det.add_tokens(ids[i : i + n]) is None
        i += n
        # Holds after every call, including while a character is incomplete.
        assert det.text == _full(tk, ids[:i], skip)
        assert _full(tk, ids[:i], skip).startswith(det.emittable_text(finished=False))
    assert det.emittable_text(finished=True) == _full(tk, ids, skip)
    assert det.token_ids == ids


def test_multibyte_character_held_back_until_complete(tok: PreTrainedTokenizerFast) -> None:
    det = _detok(tok)
    ids = _byte_ids("a😀")
    det.add_tokens(ids[:3])  # "a" + 2 of the emoji's 4 bytes
    assert det.emittable_text(finished=False) == "a"
    assert det.text == _full(tok, ids[:3]) and det.text.endswith("\ufffd")
    det.add_tokens(ids[3:])
    assert det.text == det.emittable_text(finished=False) == "a😀"


def _decode_sizes(tok: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of ids of every later `tok.decode` call (a detokenizer made after this takes the spy)."""
    sizes: list[int] = []
    real_decode = tok.decode

    def spy(token_ids: list[int], **kwargs: object) -> str:
        sizes.append(len(token_ids))
        return real_decode(token_ids, **kwargs)

    monkeypatch.setattr(tok, "decode", spy)
    return sizes


def test_decode_window_stays_small(tok: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(" ".join(_WORDS * 10))
    sizes = _decode_sizes(tok, monkeypatch)
    det = _detok(tok)
    for t in ids:  # a stream reads the text after every token
        det.add_tokens([t])
        det.emittable_text(finished=False)
    monkeypatch.undo()
    assert len(ids) > 100 and max(sizes) <= 6
    assert det.text == _full(tok, ids)


def test_text_decoded_only_when_read_without_stop_strings(tok: PreTrainedTokenizerFast,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(" ".join(_WORDS * 10))
    calls = _decode_sizes(tok, monkeypatch)
    det = _detok(tok)
    for t in ids:
        assert det.add_tokens([t]) is None
    assert calls == []  # generate() reads the text once, when the request finishes
    assert det.text == _full(tok, ids)
    assert len(calls) == 2  # the window before and after the new ids
    with_stop = _detok(tok, stop=["never appears"])
    for t in ids[:10]:  # stop strings are searched as the text grows
        before = len(calls)
        with_stop.add_tokens([t])
        assert len(calls) > before


def test_library_decode_skips_the_python_wrapper(tok: PreTrainedTokenizerFast) -> None:
    """A plain fast tokenizer is decoded by its Rust tokenizer directly, with the wrapper's text for every id."""
    ids = list(range(len(tok))) + _byte_ids("naïve 😀")
    wrapper_calls: list[int] = []
    real_decode = tok.decode
    for skip in (True, False):
        det = _detok(tok, skip_special_tokens=skip)
        det.add_tokens(ids)
        assert det.text == real_decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    class OwnDecode(PreTrainedTokenizerFast):
        def decode(self, token_ids, **kwargs):  # a subclass's own decode is always honoured
            wrapper_calls.append(len(token_ids))
            return super().decode(token_ids, **kwargs)

    own = OwnDecode(tokenizer_object=tok.backend_tokenizer, eos_token="<|eos|>")
    det = _detok(own)
    det.add_tokens(ids[:20])
    assert det.text == _full(tok, ids[:20]) and wrapper_calls
    calls_before = len(wrapper_calls)
    det = _detok(tok)
    det.add_tokens(ids[:20])
    assert det.text == _full(tok, ids[:20]) and len(wrapper_calls) == calls_before


def _run_stream(det: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None, int]:
    """Feed one token at a time; return emittable snapshots, stop reason, #tokens fed."""
    snapshots = []
    for k, t in enumerate(ids):
        hit = det.add_tokens([t])
        snapshots.append(det.emittable_text(finished=hit is not None))
        if hit is not None:
            return snapshots, hit, k + 1
    return snapshots, None, len(ids)


@pytest.mark.parametrize("split_bytes", [False, True])
def test_stop_string_spanning_tokens_truncated(tok: PreTrainedTokenizerFast, split_bytes: bool) -> None:
    text = "hello world café 日本語 the end"
    ids = _byte_ids(text) if split_bytes else tok.encode(text)
    stop = "é 日本"  # spans several tokens either way
    det = _detok(tok, stop=[stop, "zzz"])
    snapshots, hit, fed = _run_stream(det, ids)
    assert hit == stop
    assert det.text == "hello world caf"
    assert stop in _full(tok, ids[:fed]) and stop not in _full(tok, ids[: fed - 1])
    for snap in snapshots:
        assert stop not in snap and det.text.startswith(snap)
    assert snapshots[-1] == det.text
    # Later tokens are ignored once stopped.
    assert det.add_tokens(tok.encode(" more")) is None and det.text == "hello world caf"


def test_include_stop_str_in_output(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("hello world STOP the end")
    det = _detok(tok, stop="STOP", include_stop_str_in_output=True)
    _, hit, _ = _run_stream(det, ids)
    assert hit == "STOP" and det.text == "hello world STOP"


def test_earliest_stop_string_wins(tok: PreTrainedTokenizerFast) -> None:
    det = _detok(tok, stop=["world", "lo w"])
    assert det.add_tokens(tok.encode("hello world")) == "lo w"
    assert det.text == "hel"


def test_held_back_text_released_at_finish(tok: PreTrainedTokenizerFast) -> None:
    det = _detok(tok, stop=["STOPX", "zz"])
    ids = tok.encode("hello world")
    assert det.add_tokens(ids) is None
    assert det.emittable_text(finished=False) == "hello w"  # last len("STOPX") - 1 chars held
    assert det.emittable_text(finished=True) == "hello world"
    # Without stop strings nothing is held back.
    det2 = _detok(tok)
    det2.add_tokens(ids)
    assert det2.emittable_text(finished=False) == "hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: PreTrainedTokenizerFast, skip: bool) -> None:
    sp, eos, added = (tok.convert_tokens_to_ids(t) for t in ("<|sp|>", "<|eos|>", _ADDED))
    e_acute = _byte_ids("é")  # split by a special token in the middle of the character
    ids = tok.encode("hello") + [sp, sp] + e_acute[:1] + [eos] + e_acute[1:] + [added] + tok.encode(" end")
    det = _detok(tok, skip_special_tokens=skip)
    for t in ids:
        det.add_tokens([t])
    assert det.text == _full(tok, ids, skip)
    assert ("<|sp|>" in det.text) is (not skip)
    assert _ADDED in det.text  # non-special added tokens are always kept
    det2 = _detok(tok, skip_special_tokens=skip, spaces_between_special_tokens=False)
    det2.add_tokens(ids)
    assert det2.text == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=False)


_stop_alphabet = ["o w", "é 日", "😀", "STOP", "\n", "d e", "ll"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=_token_seqs,
    stops=st.lists(st.sampled_from(_stop_alphabet), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_properties(ids: list[int], stops: list[str], include: bool) -> None:
    tk = _tokenizer()
    det = _detok(tk, stop=stops, include_stop_str_in_output=include)
    snapshots, hit, fed = _run_stream(det, ids)
    full = _full(tk, ids[:fed])
    text = det.text
    assert full.startswith(text)
    if hit is None:
        assert text == full and not any(s in full for s in stops)
    else:
        idx = len(text) - len(hit) if include else len(text)
        assert full[idx:].startswith(hit)
        assert not any(s in text[:idx] for s in stops)  # nothing matched earlier
        if not include:
            assert not any(s in text for s in stops)
    for prev, snap in zip(snapshots, snapshots[1:]):
        assert snap.startswith(prev)  # a stream never has to take text back
    for snap in snapshots:
        assert text.startswith(snap)
        if not include:
            assert not any(s in snap for s in stops)
    assert det.emittable_text(finished=True) == text
