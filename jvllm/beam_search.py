"""Beam search as vLLM's `LLM.beam_search`: its parameters and outputs, and the search itself, one token a round.

Each round every live beam is generated one token further as its own request (max_tokens=1, the 2 * beam_width
most likely next tokens with their logprobs); the prefix cache holds every earlier token of a beam (its partial last
page as the parent beam's cached tail), so a round is one decode step. Of each beam's candidates, those ending in
EOS join the finished beams; of the rest, the beam_width best by cumulative logprob live on. At the end the
beam_width best of finished and live beams are returned, scored as vLLM and transformers score them: cumulative
logprob / length ** length_penalty, the length counting the prompt and not a final EOS."""
from __future__ import annotations

import dataclasses
from typing import Iterable

from jvllm.outputs import Logprob, RequestOutput
from jvllm.sample.logprobs import MAX_LOGPROBS
from jvllm.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: beams kept each round, tokens to generate, whether EOS ends a beam, the temperature
    of the token sampled along with each beam's candidates, and the length penalty of the final ranking."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field, taken for its callers: beams stop at EOS only

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an int in [1, {MAX_LOGPROBS // 2}] (each round reads the "
                             f"2 * beam_width most likely tokens, at most {MAX_LOGPROBS}), got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.length_penalty != self.length_penalty or abs(self.length_penalty) == float("inf"):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    def round_params(self) -> SamplingParams:
        """What each beam's one-token request of a round asks for."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True, detokenize=False)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: its token ids (the prompt's, then the generated ones), per generated token the candidates it was
    chosen among, its cumulative logprob, and once returned its text (the whole sequence decoded, as vLLM gives it),
    finish_reason ("stop" at EOS, else "length") and stop_reason (None)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


_LARGEST_SCALE = 1e300


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, the length counting the prompt but not a final EOS."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    try:
        scale = max(length, 1) ** length_penalty
    except OverflowError:
        scale = _LARGEST_SCALE
    # extreme penalties (|length_penalty| ~ 1e300) would overflow or divide by 0: the scale stays finite and > 0
    return beam.cum_logprob / min(max(scale, 1 / _LARGEST_SCALE), _LARGEST_SCALE)


class BeamSearch:
    """One prompt's search: the live beams to extend each round and the finished ones."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Iterable[int],
                 max_model_len: int):
        """A search of max_tokens rounds, or fewer where the model's length ends the beams first."""
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.rounds_left = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.live = [BeamSearchSequence(list(prompt_token_ids), [])]
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return self.rounds_left <= 0 or not self.live

    def advance(self, outputs: list[RequestOutput]) -> None:
        """Take the round's output of each live beam (in order): keep the beam_width best continuations."""
        candidates: list[BeamSearchSequence] = []
        for beam, output in zip(self.live, outputs, strict=True):
            steps = output.outputs[0].logprobs
            if not steps:  # the request ended without a token (aborted): the beam ends here
                self.finished.append(dataclasses.replace(beam, finish_reason="length"))
                continue
            for token_id, logprob in steps[0].items():
                extended = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [steps[0]],
                                              beam.cum_logprob + logprob.logprob)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    extended.finish_reason = "stop"
                    self.finished.append(extended)
                else:
                    candidates.append(extended)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)  # live beams all have the same length
        self.live = candidates[:self.params.beam_width]
        self.rounds_left -= 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the finished and the live beams, best first (live ones finish by "length")."""
        beams = self.finished + [dataclasses.replace(beam, finish_reason="length") for beam in self.live]
        beams.sort(key=lambda b: beam_score(b, self.eos_token_ids, self.params.length_penalty), reverse=True)
        return beams[:self.params.beam_width]
