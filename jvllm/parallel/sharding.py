"""Shard-by-shard weight placement: each device reads only its slice of each tensor (no full matrix anywhere).

KV heads: with tp > num_kv_heads (tp a multiple of it) each KV head is repeated tp / num_kv_heads times in
k_proj / v_proj (weights and biases) while loading, so every shard holds exactly one KV head and the page pool
has tp KV heads. Query head h of shard s = h // (H / tp) uses original KV head h // (H / KVH) = s // repeat,
which is the head that shard s received: the GQA grouping is unchanged.
Vocabulary and MLP widths that tp does not divide are padded with zeros (zero embedding rows and LM-head
columns give logits the step functions slice off; zero gate/up columns and down rows add exactly 0)."""
from __future__ import annotations

import contextlib
import dataclasses
import glob
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from jvllm.parallel.mesh import PADDABLE_AXES, check_tensor_parallel_size, named_sharding
from jvllm.utils import cdiv
from models.config import ModelConfig
from models.hf_names import DerivedTensors, TensorSource


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """How one model is split over tp devices."""

    tp: int
    kv_repeat: int  # copies of each original KV head (1: KV heads are split as they are)
    head_dim: int
    padded: dict[str, int]  # logical axis -> size after padding to a multiple of tp (only those padded)

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp: int) -> "TensorParallelPlan":
        check_tensor_parallel_size(tp, cfg.num_heads, cfg.num_kv_heads)
        repeat = tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1
        sizes = {"vocab": cfg.vocab_size, "mlp": cfg.intermediate_size}
        if cfg.moe is not None:
            sizes.update(expert_mlp=cfg.moe.intermediate_size, shared_mlp=cfg.moe.shared_intermediate_size)
        padded = {axis: cdiv(size, tp) * tp for axis, size in sizes.items() if size % tp}
        return cls(tp, repeat, cfg.head_dim, padded)

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config the sharded module is built with: the KV heads it actually holds."""
        return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * self.kv_repeat)


class SafetensorsSource:
    """Every *.safetensors file of a folder, opened once; `read` pulls only the requested slice."""

    def __init__(self, folder: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        files = sorted(glob.glob(str(Path(folder) / "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {folder}")
        self._handles: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(file, framework="np"))
            self._handles.update({name: handle for name in handle.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self._handles[name].get_slice(name)[index])


class RenamedSource:
    """A source read under other names: `names` maps each name asked for to the stored one (a vision-language
    checkpoint's language model, stored as e.g. 'language_model.model.*', is read as 'model.*')."""

    def __init__(self, source: TensorSource, names: dict[str, str]):
        self._source, self._names = source, names

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source.shape(self._names[name])

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self._source.read(self._names[name], index)


@dataclasses.dataclass(frozen=True)
class ShardedTensor:
    """One parameter in the loaded layout (transposed, KV heads repeated, padded), read block by block."""

    source: TensorSource
    name: str
    transpose: bool
    axes: tuple[str | None, ...]
    plan: TensorParallelPlan
    dtype: Any

    @property
    def source_shape(self) -> tuple[int, ...]:
        shape = self.source.shape(self.name)
        return shape[::-1] if self.transpose else shape  # in the loaded layout, before repeat/padding

    @property
    def shape(self) -> tuple[int, ...]:
        out = []
        for axis, size in zip(self.axes, self.source_shape):
            if axis == "kv_heads":
                size *= self.plan.kv_repeat
            out.append(self.plan.padded.get(axis, size) if axis in PADDABLE_AXES else size)
        return tuple(out)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of the loaded-layout tensor, reading only the source rows/columns it needs."""
        source_index, takes, pads = [], [], []
        shape = self.shape
        for dim, (axis, size) in enumerate(zip(self.axes, self.source_shape)):
            lo, hi, _ = index[dim].indices(shape[dim]) if dim < len(index) else (0, shape[dim], 1)
            take, pad = None, 0
            if axis == "kv_heads" and self.plan.kv_repeat > 1:
                cols = np.arange(lo, hi)
                hd = self.plan.head_dim
                src = (cols // hd // self.plan.kv_repeat) * hd + cols % hd  # repeated column -> source column
                lo, hi = int(src.min()), int(src.max()) + 1
                take = src - lo
            elif hi > size:  # zero padding past the real size
                pad, hi = hi - max(size, lo), size
                lo = min(lo, size)
            source_index.append(slice(lo, hi))
            takes.append(take)
            pads.append(pad)
        block = self._read_source(tuple(source_index))
        for dim, take in enumerate(takes):
            if take is not None:
                block = np.take(block, take, axis=dim)
        if any(pads):
            block = np.pad(block, [(0, p) for p in pads])
        return np.ascontiguousarray(block.astype(self.dtype))

    def _read_source(self, index: tuple[slice, ...]) -> np.ndarray:
        shape = tuple(s.stop - s.start for s in index)
        if 0 in shape:
            return np.zeros(shape, np.float32)
        if self.transpose:
            return self.source.read(self.name, index[::-1]).T
        return self.source.read(self.name, index)


def place(tensor: ShardedTensor, mesh: Mesh) -> jax.Array:
    """A global array sharded by the tensor's logical axes; each addressable device's block read on its own."""
    cache: dict[tuple, np.ndarray] = {}  # replicated blocks are read once, not once per device

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop) for s in index)
        if key not in cache:
            cache[key] = tensor.read(index)
        return cache[key]

    return jax.make_array_from_callback(tensor.shape, named_sharding(mesh, tensor.axes), block)


def load_sharded(module: Any, source: TensorSource, plan: TensorParallelPlan, mesh: Mesh, dtype: Any) -> None:
    """Set every parameter of an abstract (eval_shape) module to its sharded array."""
    moe = getattr(getattr(module, "config", None), "moe", None)
    source = DerivedTensors(source, moe.num_experts if moe is not None else 0)
    for param, name, transpose, axes in module.hf_parameters(source):
        if name not in source:
            raise ValueError(f"weights are missing tensor {source.source_name(name)!r}")
        tensor = ShardedTensor(source, name, transpose, axes, plan, dtype)
        expected = tuple(plan.padded.get(a, n) if a in PADDABLE_AXES else n
                         for a, n in zip(axes, param.shape))
        if tensor.shape != expected:
            raise ValueError(f"tensor {name!r} has shape {source.shape(name)}, expected {param.shape}")
        param.set_value(place(tensor, mesh))


class _Everything:
    def __contains__(self, name: object) -> bool:
        return True


def hf_tensors(module: Any) -> Iterator[tuple[str, np.ndarray]]:
    """A built module's parameters as HF-named host arrays (the inverse of load_hf_weights)."""
    for param, name, transpose, _ in module.hf_parameters(_Everything()):
        array = np.asarray(param[...])
        yield name, array.T if transpose else array
