"""The worker's input for one step: each scheduled chunk as plain values (ids, pages, sampling inputs), built by the
engine from its scheduler's objects (jvllm.engine.step_plan), so the worker never reads live requests."""
from __future__ import annotations

import dataclasses

from jvllm.core.encoder_cache import MultiModalItem
from jvllm.sample.tensors import RowSpec
from jvllm.worker.batch import ChunkRow


@dataclasses.dataclass
class ChunkPlan:
    """One chunk of one request in a step."""

    request_id: str
    row: ChunkRow  # input ids (0 where a look-ahead token comes from the device), first position, page table
    spec: RowSpec  # what its sampler row needs (read only when `samples`)
    samples: bool  # reaches the request's last known token: a token is sampled from its last position
    wants_logprobs: bool  # the sampled token's logprob stats are returned
    constrained: bool  # a grammar narrows its tokens (a look-ahead step's sampler waits for it: finish_head)
    # prompt logprobs: per position of the chunk, the next prompt token (-1 past the prompt's last); None: not asked
    prompt_targets: list[int] | None = None
    encode: tuple[MultiModalItem, ...] = ()  # images to encode before the step (multimodal models)

    @property
    def num_tokens(self) -> int:
        return len(self.row.token_ids)

    @property
    def num_prompt_targets(self) -> int:
        """Positions of the chunk with a next prompt token (a prefix of the chunk)."""
        return 0 if self.prompt_targets is None else sum(target >= 0 for target in self.prompt_targets)
