"""StepCall: everything one device step takes from the host, as plain values (sent to the other hosts as is)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jvllm.sample.tensors import SamplerFlags
from jvllm.worker.step_shapes import StepShape
from models.attention import AttentionMetadata


@dataclasses.dataclass
class EncoderCall:
    """One vision-encoder step: the encoder's features of `inputs` are written into buffer `rows`."""

    shape: StepShape  # kind "encoder": `tokens` output rows, `seqs` images (LLaVA) or 1 packed sequence (Qwen2-VL)
    rows: np.ndarray  # [tokens] int32 buffer row of each output feature (padding: rows of the reserved block)
    # LLaVA: (pixels [B, C, H, W] float32,); Qwen2-VL: (patches [P, patch_dim] float32, hw positions [P, 2] int32,
    # segments [P] int32: the image of each patch, -1 padding)
    inputs: tuple[np.ndarray, ...]


@dataclasses.dataclass
class StepCall:
    """Everything one device step takes from the host: numpy arrays and static choices. Multi-host, rank 0
    sends it to the other ranks, which run the same step (jvllm.parallel.distributed)."""

    shape: StepShape
    input_ids: np.ndarray | jax.Array  # [T] int32; on the device for a look-ahead step
    positions: np.ndarray  # [T] int32; [3, T] for M-RoPE models
    metadata: AttentionMetadata  # numpy leaves
    sampling: Any = None  # SamplingTensors (numpy leaves); None for an all-logits call
    prompt_targets: np.ndarray | None = None  # [T] int32
    flags: SamplerFlags = SamplerFlags()
    mm_rows: np.ndarray | None = None  # [T] int32 encoder-buffer row per token (-1: text); multimodal models only
    encode: tuple[EncoderCall, ...] = ()  # encoder steps run before this step, which reads the rows they fill
    # [2, max_num_seqs] int32 (source, target) pages copied before the step (cached tails), padded with 0 -> 0
    page_copies: np.ndarray | None = None

    @property
    def all_logits(self) -> bool:
        return self.sampling is None
