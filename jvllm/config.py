"""Engine settings with vLLM's names, and the defaults derived from the model and the device."""
from __future__ import annotations

import dataclasses
import enum

import jax

from jvllm.utils import cdiv
from models.config import ModelConfig

_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32


class UsageContext(str, enum.Enum):
    """Who runs the engine, as vLLM names it: some defaults differ between offline use and a server."""

    LLM_CLASS = "llm_class"
    OPENAI_API_SERVER = "openai_api_server"


def default_max_num_seqs(on_cpu: bool, usage: UsageContext) -> int:
    """vLLM's defaults: 256 sequences a step, but 128 for a server on CPU, where fewer concurrent streams keep each
    token's latency down (measured: at 4 requests/s the 128-sequence server gave both more tokens a second and a
    lower TPOT than with 256; benchmarks/results/peer_serve_cpu.md)."""
    return 128 if on_cpu and usage is UsageContext.OPENAI_API_SERVER else 256


@dataclasses.dataclass
class EngineConfig:
    """The limits an engine runs with. A KV page is vLLM's "block": `page_size` is the `block_size` argument."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int  # tokens per KV page
    num_pages: int

    @property
    def max_pages_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.page_size)


def _default_kv_bytes(num_devices: int = 1) -> int:
    """Per device. CPU devices (also virtual ones) share the host's memory: 1 GiB in all."""
    if jax.default_backend() == "cpu":
        return _CPU_KV_BYTES // num_devices
    stats = jax.local_devices()[0].memory_stats() or {}  # this host's (multi-host: rank 0's count wins)
    limit, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
    return max(int(0.85 * limit) - used, _CPU_KV_BYTES)


def build_engine_config(model: ModelConfig, dtype_bytes: int, *, max_model_len: int | None,
                        max_num_seqs: int | None, max_num_batched_tokens: int | None, block_size: int,
                        kv_cache_memory_bytes: int | None, tensor_parallel_size: int = 1,
                        usage: UsageContext = UsageContext.LLM_CLASS) -> EngineConfig:
    """Fill in the defaults of the user's limits (checked by EngineArgs) against the model: the pool size from the
    memory budget.

    kv_cache_memory_bytes is per device, as in vLLM. With tensor parallelism each device holds
    num_kv_heads / tp of the KV heads (`model` is the sharded model's config: KV heads already repeated
    when tp exceeds them), so a page costs each device 1/tp of its single-device size."""
    longest = getattr(model, "longest_supported_context", model.max_position_embeddings)
    if max_model_len is not None and max_model_len > longest:
        if longest < model.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds {longest}, this LongRoPE model's original "
                             "context: past it the long factors apply to a whole sequence, which jvllm does not "
                             f"support yet; use max_model_len <= {longest}")
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{model.max_position_embeddings}")
    on_cpu = jax.default_backend() == "cpu"
    kv_heads_per_device = model.num_kv_heads // tensor_parallel_size
    bytes_per_token = 2 * model.num_layers * kv_heads_per_device * model.head_dim * dtype_bytes
    budget = kv_cache_memory_bytes or _default_kv_bytes(tensor_parallel_size)
    num_pages = budget // (bytes_per_token * block_size)
    if num_pages < 2:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds fewer than 2 pages of {block_size} tokens "
                         f"({bytes_per_token * block_size} bytes each per device)")
    pool_tokens = (num_pages - 1) * block_size
    max_model_len = max_model_len or min(longest, pool_tokens)
    max_num_seqs = max_num_seqs or default_max_num_seqs(on_cpu, usage)
    max_num_batched_tokens = max_num_batched_tokens or (2048 if on_cpu else 8192)
    return EngineConfig(max_model_len, max_num_seqs, max_num_batched_tokens, block_size, int(num_pages))
