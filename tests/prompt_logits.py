"""Logits at every position of one prompt through an engine's paged path (the parity tests' probe)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from jvllm.core.encoder_cache import EncoderBudget, EncoderCache, MultiModalItem
from jvllm.engine.step_plan import encode_items
from jvllm.multimodal.positions import mrope_positions
from jvllm.parallel.mesh import host_array
from jvllm.utils import cdiv
from jvllm.worker.batch import ChunkRow
from jvllm.worker.compile_watch import compile_watch
from jvllm.worker.model_runner import ModelRunner
from jvllm.worker.step_call import EncoderCall, StepCall


def prompt_logits(runner: ModelRunner, token_ids: list[int], mm_items: list[MultiModalItem] = (),
                  encoder_cache: EncoderCache | None = None) -> np.ndarray:
    """Logits [T, V] at every position of one prompt, through the paged path as one fresh chunk. Nothing is
    written to the pool (pages listed are the reserved page 0, never read: the chunk is its whole context).
    `mm_items`: the prompt's images (multimodal models), encoded first into rows of `encoder_cache` (the engine's)."""
    n = len(token_ids)
    if not runner.backend.attends_step_kv:
        raise NotImplementedError(f"prompt_logits needs a backend that attends to a fresh chunk's own K/V "
                                  f"without writing the pool (xla), not {runner.backend.name}")
    if n > runner.shapes.max_num_batched_tokens:
        raise ValueError(f"prompt_logits takes at most {runner.shapes.max_num_batched_tokens} tokens, got {n}")
    shape = runner.shapes.prefill(n)
    mm_rows, encode = _encode(runner, encoder_cache, mm_items, n) if mm_items else (None, ())
    row = ChunkRow(token_ids=list(token_ids), start=0, page_table=[0] * cdiv(n, runner.page_size), mm_rows=mm_rows,
                   positions=mrope_positions(mm_items, 0, n) if runner.mrope and mm_items else None)
    batch = runner.host_batch([row], shape)
    with compile_watch().expected():  # a diagnostic: its executable is compiled on first use
        logits = runner.run_call(StepCall(shape, batch.input_ids, batch.positions, batch.metadata,
                                          mm_rows=batch.mm_rows, encode=encode))
    return (host_array(logits) if runner.mesh is not None else np.asarray(logits))[:n]


def _encode(runner: ModelRunner, cache: EncoderCache | None, items: list[MultiModalItem],
            num_tokens: int) -> tuple[list[int], tuple[EncoderCall, ...]]:
    """Rows for a prompt's images outside any step's budget -> (its tokens' buffer rows, the encoder steps of the
    images not cached yet)."""
    if runner.encoder is None or cache is None:
        raise ValueError("images need a vision-language model's runner and its engine's encoder cache")
    holder = SimpleNamespace(request_id="prompt-logits", mm_items=list(items))
    budget = EncoderBudget(sum(item.length for item in items))
    if cache.schedule(holder, 0, num_tokens, budget) != num_tokens:
        raise ValueError("the encoder cache cannot hold this prompt's images")
    new = [item for _, item in budget.to_encode.values()]
    calls = tuple(runner.encoder.calls(encode_items(new, cache)))
    cache.mark_ready(new)
    rows = cache.token_rows(holder, 0, num_tokens)
    cache.release(holder)
    return rows, calls


def blocks_take_float_activations(runner: ModelRunner, length: int) -> bool:
    """Whether every quantized product of `prompt_logits(runner, ids[:length])` multiplies the blocks with float32
    activations (the float tiles of AVX2 builds, between the build's int16 row paths: cpu_kernels.quantized_matmul),
    rather than some with activations quantized to int16 (within ~3e-5 of float32). The layers take the live rows'
    path, the all-position LM head the padded step's."""
    from cpu_kernels.quantized_matmul import row_path_limits

    max_rows, tile_min_rows = row_path_limits()
    if _interleaved_blocks(runner):  # int16 activations at every row count
        return False
    return max_rows < length and runner.shapes.prefill(length).tokens < tile_min_rows


def _interleaved_blocks(runner: ModelRunner) -> bool:
    """Whether some projection of the runner's model holds blocks interleaved by rows (models.quantized.INTERLEAVED),
    which the kernels multiply with int16 activations at every row count."""
    from jvllm.worker.weights import block_formats
    from models.quantized import INTERLEAVED

    return bool(block_formats(runner.loaded) & INTERLEAVED.keys())
