"""Start-up pieces of an Engine that need only its arguments and model: its limits, its end-of-sequence ids and
the ready line."""
from __future__ import annotations

import logging
from typing import Any

import jax.numpy as jnp

from jvllm.config import EngineConfig, UsageContext, build_engine_config
from jvllm.engine.arg_utils import EngineArgs
from jvllm.model_loader.generation_defaults import generation_defaults
from jvllm.parallel import distributed
from jvllm.sampling_params import SamplingParams

logger = logging.getLogger("jvllm")


def engine_config_for(model: Any, args: EngineArgs, kv_dtype: Any, usage: UsageContext,
                      multi_host: bool) -> EngineConfig:
    """The engine's limits and KV pool size: an encoder's (no pool) or a generator's, the same page count on every
    host (rank 0's wins)."""
    if model.is_encoder:  # embeddings only: no KV pool, no runner
        from jvllm.pooling.embedder import encoder_engine_config

        return encoder_engine_config(model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                     max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size)
    config = build_engine_config(
        model.config, kv_dtype.itemsize, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, tensor_parallel_size=args.tensor_parallel_size,
        usage=usage)
    if multi_host:
        config.num_pages = distributed.agree_on_int(config.num_pages)
    return config


def attention_backend_for(name: str, model: Any) -> str:
    """The attention backend's name. An encoder (embeddings, scores) runs no paged attention: for it "auto" is
    "xla", so that no native kernels are built for nothing."""
    from jvllm.attention import resolve_backend_name

    return "xla" if name == "auto" and model.is_encoder else resolve_backend_name(name)


def drop_unread_weights(model: Any, runner: Any, embedder: Any) -> None:
    """Free the loaded float matrices where no step reads them: a float checkpoint on CPU, whose steps of every row
    count read the bf16 copy (an embedder on the generative model reads the loaded ones)."""
    if runner is not None and embedder is None and runner.step_weights.every_step_reads_the_copy:
        runner.step_weights.drop_loaded()
        model.drop_float_matrices()


def log_ready(engine: Any, backend: str, seconds: float) -> None:
    """One line with what the engine loaded and how long start-up took."""
    model, cfg = engine.model, engine.config
    step_weights = None if engine.runner is None else engine.runner.step_weights
    if model.keeps_blocks:
        matrices = " with GGUF blocks"
    elif step_weights is not None and step_weights.every_step_reads_the_copy \
            and step_weights.batched_dtype != jnp.dtype(model.dtype):
        matrices = f" with {step_weights.batched_dtype.name} matrices"  # e.g. a float checkpoint's bf16 copy on CPU
    else:
        matrices = ""
    logger.info("engine ready: %s (%s%s, weights %.0f MB, %s attention, max_model_len %d, tensor_parallel_size %d) in "
                "%.1fs", model.served_name, jnp.dtype(model.dtype).name, matrices, engine.weight_bytes / 1e6,
                backend if engine.runner is None else engine.runner.backend.name, cfg.max_model_len,
                engine.args.tensor_parallel_size, seconds)


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The model config's end-of-sequence ids and the tokenizer's, sorted."""
    ids = set(model.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def model_sampling_defaults(args: EngineArgs, model_folder: Any) -> dict[str, Any]:
    """The SamplingParams keywords the model's generation config sets (EngineArgs.generation_config), checked by
    building SamplingParams from them, and logged as vLLM logs them."""
    values = generation_defaults(args.generation_config, model_folder, args.override_generation_config)
    if values:
        try:
            SamplingParams(**values)
        except ValueError as error:
            raise ValueError(f"the model's generation config gives invalid sampling defaults: {error}") from None
        logger.info("default sampling parameters from the model's generation config: %s (generation_config='vllm' "
                    "ignores it)", values)
    return values
