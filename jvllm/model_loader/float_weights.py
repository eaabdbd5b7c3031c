"""A float checkpoint's weights, read tensor by tensor from its safetensors files into the module's parameters."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jvllm.model_loader.read_progress import weight_bar
from models.config import ModelConfig
from models.layers import is_float_matrix


def takes_matrix_dtype(config: Any, matrix_dtype: Any, *, blocks: bool, quantization: str | None,
                       tensor_parallel_size: int) -> bool:
    """Whether a model loads its float matrices in `matrix_dtype` rather than its dtype: a decoder (not an encoder,
    whose embeddings stay in float32), without stacked experts, neither GGUF blocks nor quantized at load, on one
    device (jvllm.worker.weights.StepWeights: the steps that read only a bf16 copy of the matrices)."""
    return (matrix_dtype is not None and isinstance(config, ModelConfig) and config.moe is None and not blocks
            and quantization is None and tensor_parallel_size == 1)


class _ReadProgress:
    """A tensor source whose reads advance a byte progress bar."""

    def __init__(self, source: Any, bar: Any):
        self._source, self._bar = source, bar

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source.shape(name)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        array = self._source.read(name, index)
        self._bar.update(array.nbytes)
        return array


def load_float_weights(module: Any, folder: Path, dtype: Any, matrix_dtype: Any = None) -> None:
    """Fill an abstract (eval_shape) module from the folder's *.safetensors, one tensor at a time, so that at most
    one tensor is held besides the parameters already set. `matrix_dtype`: the weight matrices' dtype (None:
    `dtype`)."""
    from jvllm.parallel.sharding import SafetensorsSource

    with contextlib.ExitStack() as stack:
        source = SafetensorsSource(folder, stack)
        bar = stack.enter_context(weight_bar(sum(os.path.getsize(file) for file in Path(folder).glob("*.safetensors"))))
        module.load_hf_weights(_ReadProgress(source, bar), dtype, matrix_dtype)


def cast_float_matrices(module: Any, matrix_dtype: Any) -> None:
    """Every float matrix parameter of a module in `matrix_dtype` (random weights drawn in the model's dtype)."""
    for _, param in nnx.iter_graph(module):
        if not isinstance(param, nnx.Param):
            continue
        value = param.get_value()
        if isinstance(value, jax.Array) and is_float_matrix(value):
            param.set_value(value.astype(matrix_dtype))
