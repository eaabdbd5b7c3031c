"""Sentence pooling: read a folder's sentence-transformers config, resolve user overrides, pool on device."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

POOLING_MODES = ("mean", "cls", "last", "max", "mean_sqrt_len")

# sentence-transformers' names (legacy boolean keys and the newer single `pooling_mode`) -> ours
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len"}
_ST_LEGACY_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                   "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean"}
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How one sequence's hidden states [L, D] become one embedding [D]."""

    mode: str  # one of POOLING_MODES
    normalize: bool  # L2-normalize the pooled vector


@dataclasses.dataclass(frozen=True)
class SentenceTransformersConfig:
    """What a sentence-transformers folder says: its pooling and its max_seq_length (None when unset)."""

    pooling: PoolingConfig
    max_seq_length: int | None


def read_sentence_transformers_config(folder: Path) -> SentenceTransformersConfig | None:
    """Parse modules.json (+ 1_Pooling/config.json, sentence_bert_config.json); None if not an ST folder.

    Modules we cannot reproduce (Dense projections, ...) raise rather than silently change the embedding."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    mode, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Transformer") or kind == _ST_TRANSFORMER:
            continue
        if kind.endswith("Pooling") or kind == _ST_POOLING:
            mode = _pooling_mode(folder / module.get("path", ""))
        elif kind.endswith("Normalize") or kind == _ST_NORMALIZE:
            normalize = True
        else:
            raise ValueError(f"unsupported sentence-transformers module {kind!r} in {modules_file}; "
                             "supported: Transformer, Pooling, Normalize")
    max_len = None
    st_file = folder / "sentence_bert_config.json"
    if st_file.is_file():
        max_len = json.loads(st_file.read_text()).get("max_seq_length")
    return SentenceTransformersConfig(PoolingConfig(mode or "mean", normalize), int(max_len) if max_len else None)


def _pooling_mode(module_folder: Path) -> str:
    config_file = module_folder / "config.json"
    if not config_file.is_file():
        return "mean"  # sentence-transformers' Pooling default
    config = json.loads(config_file.read_text())
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [name for key, name in _ST_LEGACY_KEYS.items() if config.get(key)]
    if config.get("include_prompt") is False:
        raise ValueError(f"{config_file}: include_prompt=false (pooling that skips an instruction prompt) "
                         "is not supported")
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{config_file}: pooling {modes} is not supported; supported: one of {sorted(_ST_MODES)}")
    return _ST_MODES[modes[0]]


def resolve_pooling(folder_config: SentenceTransformersConfig | None, *, is_encoder: bool, pooling: str | None,
                    normalize: bool | None) -> PoolingConfig | None:
    """The pooling an engine uses, or None when the model does not embed (a causal LM with no choice).

    An explicit `pooling` / `normalize` wins over the folder's config. Defaults as vLLM's: an encoder
    without a sentence-transformers config pools CLS; a causal LM embeds only when asked (`pooling="last"`
    is the usual choice); both normalize unless told not to."""
    if pooling is not None and pooling not in POOLING_MODES:
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLING_MODES)}")
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError(f"normalize must be None, True or False, got {normalize!r}")
    if pooling is None and not is_encoder:
        if normalize is not None:
            raise ValueError("normalize= needs pooling= on a generative model (e.g. pooling='last')")
        return None
    if folder_config is not None:
        base = folder_config.pooling
    else:
        base = PoolingConfig("cls" if is_encoder else "last", True)
    return PoolingConfig(pooling or base.mode, base.normalize if normalize is None else normalize)


def pool(hidden: jax.Array, slots: jax.Array, positions: jax.Array, num_slots: int, mode: str) -> jax.Array:
    """hidden [T, D], slots [T] (the output row of each token's sequence; num_slots for padding), positions
    [T] (index within its sequence) -> [num_slots, D] float32; empty slots give zeros."""
    h = hidden.astype(jnp.float32)
    real = slots < num_slots  # [T]
    count = jax.ops.segment_sum(real.astype(jnp.float32), slots, num_segments=num_slots)  # [S]
    if mode == "max":
        pooled = jax.ops.segment_max(jnp.where(real[:, None], h, -jnp.inf), slots, num_segments=num_slots)
        return jnp.where(count[:, None] > 0, pooled, 0.0)
    if mode == "cls":
        weight = real & (positions == 0)
    elif mode == "last":
        length = count[jnp.minimum(slots, num_slots - 1)]  # [T] the length of each token's sequence
        weight = real & (positions == length - 1)
    elif mode in ("mean", "mean_sqrt_len"):
        weight = real
    else:
        raise ValueError(f"unknown pooling mode {mode!r}")
    total = jax.ops.segment_sum(h * weight[:, None].astype(jnp.float32), slots, num_segments=num_slots)  # [S, D]
    if mode == "mean":
        return total / jnp.maximum(count, 1e-9)[:, None]  # clamped as sentence-transformers does
    if mode == "mean_sqrt_len":
        return total / jnp.sqrt(jnp.maximum(count, 1e-9))[:, None]
    return total

