"""A model's default sampling parameters from its generation_config.json, as vLLM takes them (`generation_config`:
"auto" reads the model's folder, "vllm" ignores it, a folder path reads that one's; `override_generation_config`
sets values on top)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json field -> SamplingParams field, and the value transformers' GenerationConfig has by default
# (a file that repeats a default does not change vLLM's defaults: vLLM reads only the fields that differ).
FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
          "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
          "max_new_tokens": ("max_tokens", None)}


def generation_defaults(source: str, model_folder: Path | None,
                        overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """-> SamplingParams keywords (possibly none) that replace SamplingParams' own defaults for this model.
    ValueError for a folder without generation_config.json, an unreadable file or an unknown override."""
    values: dict[str, Any] = {}
    if source == "auto":
        path = None if model_folder is None else Path(model_folder) / "generation_config.json"
        if path is not None and path.is_file():
            values = _read(path)
    elif source != "vllm":
        path = Path(source).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config={source!r}: no generation_config.json there (give 'auto', 'vllm' or "
                             "a folder holding one)")
        values = _read(path)
    unknown = sorted(set(overrides or {}) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown fields {unknown}; known: {', '.join(FIELDS)}")
    values.update({FIELDS[name][0]: value for name, value in (overrides or {}).items()})
    return values


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"could not read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {field: config[name] for name, (field, default) in FIELDS.items()
            if config.get(name) is not None and config[name] != default}
