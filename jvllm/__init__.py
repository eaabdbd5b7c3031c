"""jvllm: a JAX/XLA LLM inference and serving engine with vLLM's API."""
from __future__ import annotations

import importlib
from typing import Any

from jvllm.third_party_logs import quiet_third_party_notices
from jvllm.worker.xla_flags import apply_cpu_defaults

__version__ = "0.1.0"
apply_cpu_defaults()  # before anything starts a JAX backend
quiet_third_party_notices()

_EXPORTS = {
    "Engine": "jvllm.engine.llm",
    "LLM": "jvllm.engine.llm",
    "SamplingParams": "jvllm.sampling_params",
    "StructuredOutputsParams": "jvllm.sampling_params",
    "PoolingParams": "jvllm.pooling_params",
    "BeamSearchParams": "jvllm.beam_search",
    "RequestOutput": "jvllm.outputs",
    "CompletionOutput": "jvllm.outputs",
    "EmbeddingRequestOutput": "jvllm.outputs",
    "EmbeddingOutput": "jvllm.outputs",
    "PoolingRequestOutput": "jvllm.outputs",
    "PoolingOutput": "jvllm.outputs",
    "ScoringRequestOutput": "jvllm.outputs",
    "ScoringOutput": "jvllm.outputs",
    "AsyncEngine": "jvllm.engine.async_engine",
    "EngineArgs": "jvllm.engine.arg_utils",
}


def __getattr__(name: str) -> Any:
    # Lazy so `import jvllm` (and `jvllm --help`) does not pay for importing jax.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jvllm' has no attribute {name!r}")


__all__ = ["__version__", *_EXPORTS]
