"""Whether a batch of several decoding requests speculates, from the engine's own step times: the batch size where
verifying drafts stops paying belongs to the machine (docs/design.md, speculative decoding)."""
from __future__ import annotations

import dataclasses

MIN_SAMPLES = 3  # steps of each kind a batch size needs before the faster kind is chosen
EXPLORE_EVERY = 16  # every this many steps of a batch size, one of the kind not chosen (the machine's speed moves)
SMOOTHING = 0.25  # weight of a new step in the moving sums of tokens and seconds


@dataclasses.dataclass
class _Rate:
    """Moving sums of the tokens a kind of step emitted and the seconds it took."""

    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        weight = 1.0 if self.samples == 0 else SMOOTHING
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)
        self.samples += 1

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class BatchPolicy:
    """For 2..max_batch_size decoding requests, the tokens a second of steps that verified drafts against steps that
    did not, as the engine timed them; a batch speculates while its verifying steps are the faster, and tries the
    other kind once every EXPLORE_EVERY steps. A lone request always may (its own back-off decides); larger batches
    never do."""

    def __init__(self, max_batch_size: int, timed: bool = True):
        """`timed`=False: every batch of up to max_batch_size requests speculates."""
        self.max_batch_size = max_batch_size
        self.timed = timed
        self._rates: dict[tuple[int, bool], _Rate] = {}
        self._steps: dict[int, int] = {}

    def _rate(self, batch: int, verified: bool) -> _Rate:
        return self._rates.setdefault((batch, verified), _Rate())

    def speculates(self, batch: int) -> bool:
        """Whether a step of `batch` running requests should verify drafts (the same answer until the next
        `record`)."""
        if batch > self.max_batch_size:
            return False
        if batch <= 1 or not self.timed:
            return True
        verifying, plain = self._rate(batch, True), self._rate(batch, False)
        if verifying.samples < MIN_SAMPLES or plain.samples < MIN_SAMPLES:
            return verifying.samples <= plain.samples
        faster = verifying.tokens_per_second >= plain.tokens_per_second
        explore = self._steps.get(batch, 0) % EXPLORE_EVERY == EXPLORE_EVERY - 1
        return faster != explore

    def record(self, batch: int, verified: bool, tokens: int, seconds: float) -> None:
        """A decode step of `batch` requests (drafts verified or not) emitted `tokens` in `seconds`."""
        if not 2 <= batch <= self.max_batch_size or seconds <= 0:
            return
        self._rate(batch, verified).add(tokens, seconds)
        self._steps[batch] = self._steps.get(batch, 0) + 1
