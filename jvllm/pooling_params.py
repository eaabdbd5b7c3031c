"""PoolingParams: per-call options of embedding (LLM.encode / LLM.embed), as vLLM spells them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOLING_TASKS = ("embed",)  # what LLM.encode computes (vLLM also names "classify", "score", "token_embed", ...)


@dataclass(kw_only=True)
class PoolingParams:
    """truncate_prompt_tokens: keep each prompt's last k tokens (-1: max_model_len); dimensions: shorten a
    Matryoshka model's embeddings; normalize: scale each embedding to unit length (True), return the pooled
    vector as it is (False), or do what the model's pooling config says (None)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")
        for name in ("truncate_prompt_tokens", "dimensions"):
            value: Any = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an int or None, got {value!r}")


def embed_options(params: PoolingParams | None, truncate_prompt_tokens: int | None,
                  pooling_task: str | None) -> dict[str, Any]:
    """LLM.encode's arguments -> LLM.embed's keyword options; ValueError for a task it does not compute."""
    if pooling_task not in (None, *POOLING_TASKS):
        raise ValueError(f"pooling_task {pooling_task!r} is not supported; LLM.encode computes {POOLING_TASKS} "
                         "(cross-encoders score pairs with LLM.score)")
    if params is not None and not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    params = params or PoolingParams()
    given = params.truncate_prompt_tokens if truncate_prompt_tokens is None else truncate_prompt_tokens
    return {"truncate_prompt_tokens": given, "dimensions": params.dimensions, "normalize": params.normalize}
