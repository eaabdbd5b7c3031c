"""The closed set of step shapes an engine runs, known from its config alone and compiled before it serves.

A step is one device call of one kind over T flat tokens and S sequence rows:
- decode: every row one token (T == S), T a power of two up to max_num_seqs;
- prefill: any mix of chunks, T a power of two from PREFILL_MIN_TOKENS up to max_num_batched_tokens, and
  S = min(T, max_num_seqs) rows (a chunk has at least one token).
Nothing else varies: page tables are max_model_len wide, and sampling and logprob options are runtime
values, not shapes."""
from __future__ import annotations

import dataclasses

from jvllm.utils import next_power_of_2

PREFILL_MIN_TOKENS = 16
# A step's fixed cost (every weight read once, every layer dispatched) in prefill tokens: a CPU step of 1-64 token
# rows costs about what 48 prefill tokens do (benchmarks.step_times on the 2-core CPU, SmolLM2: a 1-row decode step
# ~33 ms, a 2048-token prefill step ~0.7 ms per token).
STEP_FLOOR_TOKENS = 48


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    kind: str  # "decode" or "prefill"
    tokens: int  # T
    seqs: int  # S

    def __str__(self) -> str:
        return f"{self.kind} T={self.tokens} S={self.seqs}"


def _buckets(first: int, last: int) -> list[int]:
    """Powers of two from `first` while below `last`, then `last` itself."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= 2
    return sizes + [last]


@dataclasses.dataclass(frozen=True)
class ShapeSet:
    """The step shapes of one engine, and the smallest one that holds a given step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    min_rows: int = 1  # 2 when one-row steps are slow (16-bit weights on XLA CPU): decode buckets start there

    @property
    def decode_sizes(self) -> list[int]:
        return _buckets(min(next_power_of_2(self.min_rows), self.max_num_seqs), self.max_num_seqs)

    @property
    def prefill_sizes(self) -> list[int]:
        return _buckets(min(PREFILL_MIN_TOKENS, self.max_num_batched_tokens), self.max_num_batched_tokens)

    def shapes(self) -> list[StepShape]:
        decode = [StepShape("decode", n, n) for n in self.decode_sizes]
        prefill = [StepShape("prefill", n, min(n, self.max_num_seqs)) for n in self.prefill_sizes]
        return decode + prefill

    def reachable(self, max_step_tokens: int, max_rows: int) -> list[StepShape]:
        """The shapes a workload known up front can meet: steps of at most `max_step_tokens` tokens (a prompt plus
        its output, as a preempted request recomputes both) and `max_rows` sequences."""
        largest_decode = self.decode(min(max_rows, self.max_num_seqs))
        largest_prefill = self.prefill(min(max(max_step_tokens, 1), self.max_num_batched_tokens))
        return [shape for shape in self.shapes()
                if shape <= (largest_decode if shape.kind == "decode" else largest_prefill)]

    def decode(self, num_rows: int) -> StepShape:
        size = next(n for n in self.decode_sizes if n >= num_rows)
        return StepShape("decode", size, size)

    def prefill(self, num_tokens: int) -> StepShape:
        size = next(n for n in self.prefill_sizes if n >= num_tokens)
        return StepShape("prefill", size, min(size, self.max_num_seqs))

    def mixed_is_cheaper(self, decode_rows: int, prefill_tokens: int) -> bool:
        """Whether one prefill step holding both the decode rows and the prefill chunks costs no more than a decode
        step plus a prefill step: cost ~ padded tokens, with a floor of STEP_FLOOR_TOKENS per step."""
        total = decode_rows + prefill_tokens
        if total > self.max_num_batched_tokens:
            return False
        cost = lambda shape: max(shape.tokens, STEP_FLOOR_TOKENS)  # noqa: E731
        return cost(self.prefill(total)) <= cost(self.decode(decode_rows)) + cost(self.prefill(prefill_tokens))
