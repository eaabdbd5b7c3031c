"""What a dispatched step leaves the engine: its device call in flight (DispatchedGroup), a sampler that waits
(PendingHead), and each chunk's outcome once read back (StepResult)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jvllm.sample.logprobs import TokenLogprobs
from jvllm.worker.step_call import StepCall
from jvllm.worker.step_launcher import Launch
from jvllm.worker.step_plan import ChunkPlan


@dataclasses.dataclass
class StepResult:
    """One chunk's outcome: the sampled token (None for a prompt chunk that does not sample) and, if asked,
    its logprob stats and the prompt logprobs of prompt tokens prompt_start, prompt_start + 1, ..."""

    token_id: int | None
    token_logprobs: TokenLogprobs | None  # the sampled token's logprob, rank and top-k, when the request asked
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    prompt_start: int = 1
    # a chunk with draft tokens: what was sampled after each draft, in order (valid while the drafts match)
    after_drafts: list[StepResult] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PendingHead:
    """A step whose layers are dispatched and whose sampler waits: a look-ahead step of grammar-constrained rows
    samples once the previous step's tokens have advanced their grammars (ModelRunner.finish_head)."""

    run: Callable[[Any], dict]  # device sampling tensors -> the head's outputs


@dataclasses.dataclass
class DispatchedGroup:
    """One device call started by ModelRunner.dispatch; `out` holds its device outputs (None while `pending`, and
    while `launch`, its calls, is still being dispatched on the dispatch thread: `settle` waits for that)."""

    plans: list[ChunkPlan]
    call: StepCall
    out: Any
    pending: PendingHead | None = None
    head_waits: bool = False  # its sampler waits for finish_head (grammar-constrained look-ahead rows)
    launch: Launch | None = None

    def settle(self) -> DispatchedGroup:
        """Wait until the host has dispatched this group's calls (not for the device); -> self."""
        launch = self.launch
        if launch is not None:
            value = launch.result()
            if self.head_waits:
                self.pending = value
            else:
                self.out = value
            self.launch = None
        return self


def sampler_token_index(plans: list[ChunkPlan]) -> list[int]:
    """The flat step token each sampler row samples after: a chunk's last token, or with draft tokens its last known
    token and each draft."""
    index, cursor = [], 0
    for plan in plans:
        last = cursor + plan.num_tokens - 1
        index += range(last - plan.sampler_rows + 1, last + 1)
        cursor += plan.num_tokens
    return index
