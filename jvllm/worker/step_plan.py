"""The worker's input for one step: each scheduled chunk as plain values (ids, pages, sampling inputs, images to
encode with their buffer rows), built by the engine from its scheduler's objects (jvllm.engine.step_plan), so the
worker never reads live requests nor the scheduler's encoder cache."""
from __future__ import annotations

import dataclasses

import numpy as np

from jvllm.sample.tensors import RowSpec
from jvllm.worker.batch import ChunkRow


@dataclasses.dataclass(eq=False)
class EncodeItem:
    """One image the vision encoder runs on before the step: its input, and the encoder-buffer rows its features
    go to (the engine's EncoderCache chose them)."""

    key: int  # the image's content hash (for logs and tests: the worker keys nothing on it)
    rows: np.ndarray  # [n] int32 buffer rows of its n output features, in order
    data: np.ndarray  # float32 pixels [C, H, W] (LLaVA) or flattened patches [n x merge unit, patch_dim] (Qwen2-VL)
    grid: tuple[int, int] | None = None  # its tokens' (rows, columns) in the image (Qwen2-VL)

    @property
    def length(self) -> int:
        """Its output features (= placeholder tokens)."""
        return int(self.rows.shape[0])


@dataclasses.dataclass
class ChunkPlan:
    """One chunk of one request in a step."""

    request_id: str
    row: ChunkRow  # input ids (0 where a look-ahead token comes from the device), first position, page table
    spec: RowSpec  # what its sampler row needs (read only when `samples`); with drafts, the first verified position
    samples: bool  # reaches the request's last known token: a token is sampled from its last position
    wants_logprobs: bool  # the sampled token's logprob stats are returned
    constrained: bool  # a grammar narrows its tokens (a look-ahead step's sampler waits for it: finish_head)
    # prompt logprobs: per position of the chunk, the next prompt token (-1 past the prompt's last); None: not asked
    prompt_targets: list[int] | None = None
    encode: tuple[EncodeItem, ...] = ()  # images to encode before the step (multimodal models)
    # speculative decoding: the chunk's last len(draft_ids) tokens are proposed, not known; a token is sampled after
    # the last known token and after each draft (verify_specs: the sampler rows after each draft, in order)
    draft_ids: tuple[int, ...] = ()
    verify_specs: tuple[RowSpec, ...] = ()
    # a request starting from a cached partial page: (that page, the request's own copy), copied before the step
    page_copy: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.row.token_ids)

    @property
    def sampler_rows(self) -> int:
        """Rows of the step's sampler this chunk takes: one per verified position when it samples, else one."""
        return 1 + len(self.draft_ids) if self.samples else 1

    @property
    def num_prompt_targets(self) -> int:
        """Positions of the chunk with a next prompt token (a prefix of the chunk)."""
        return 0 if self.prompt_targets is None else sum(target >= 0 for target in self.prompt_targets)
