"""Shared by the vision sides (models.llava, models.qwen2_vl): filling a module's parameters from HF tensors, and
splitting a vision-language checkpoint's tensors by name into the vision side's and the language model's."""
from __future__ import annotations

from typing import Iterable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

# (parameter, HF tensor name, stored transposed vs. the HF tensor)
VisionParameter = tuple[nnx.Param, str, bool]
TEXT_PREFIXES = ("model.", "lm_head.")  # canonical names of the language model's tensors


def load_parameters(parameters: Iterable[VisionParameter], tensors: Mapping[str, np.ndarray], dtype: jnp.dtype) -> None:
    """Set every parameter from its tensor; ValueError naming the first missing one."""
    for param, name, transpose in parameters:
        if name not in tensors:
            raise ValueError(f"weights are missing tensor {name!r}")
        array = np.asarray(tensors[name])
        if transpose:  # torch [out, in] (a conv kernel [out, C, ...]) -> [in, out]
            array = array.reshape(array.shape[0], -1).T
        param.set_value(jnp.asarray(array, dtype=dtype))


def canonical_name(name: str, prefixes: tuple[tuple[str, str], ...]) -> str | None:
    """`name` with the first matching (old, new) prefix replaced; None for tensors of no part."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return None


def split_tensors(tensors: Mapping[str, np.ndarray], prefixes: tuple[tuple[str, str], ...]
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """-> (the vision side's tensors, the language model's under 'model.' / 'lm_head.'), by canonical name."""
    vision: dict[str, np.ndarray] = {}
    text: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        canonical = canonical_name(name, prefixes)
        if canonical is not None:
            (text if canonical.startswith(TEXT_PREFIXES) else vision)[canonical] = array
    return vision, text
