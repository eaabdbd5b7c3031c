"""Attention backends behind one interface, and their registry (backends load lazily, by name)."""
from __future__ import annotations

from typing import Callable

import jax

from cpu_kernels.build import available as cpu_kernels_available

from jvllm.attention.backend import AttentionBackend, InStepWrite, SeparateWrite

_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, loader: Callable[[], AttentionBackend]) -> None:
    """Register a backend by name; `loader` imports it lazily so optional backends cost nothing."""
    _BACKENDS[name] = loader


def _load_xla() -> AttentionBackend:
    from jvllm.attention import pool_storage, xla

    return SeparateWrite("xla", xla.class_layout, xla.paged_attention, xla.write_layers,
                         storage_dtype=pool_storage.storage_dtype)


def _load_cpu() -> AttentionBackend:
    from jvllm.attention import native

    return native.NativeCpu("cpu", native.no_layout, native.write_and_attend, fallback=_load_xla)


def _load_pallas(name: str = "pallas", kernels: str = "triton") -> AttentionBackend:
    import functools

    from jvllm.attention import pallas

    layout_for = functools.partial(pallas.layout_for, kernels=kernels)
    return InStepWrite(name, layout_for(1, 1, 128, "bfloat16"),
                       functools.partial(pallas.write_and_attend, kernels=kernels), layout_for=layout_for)


def _load_mosaic() -> AttentionBackend:
    from pallas_kernels.mosaic_common import mosaic_gpu_available

    if not mosaic_gpu_available():
        raise ValueError(f"attention_backend 'mosaic' needs jax >= 0.11 (Mosaic GPU's plgpu.kernel); this is jax "
                         f"{jax.__version__}: use 'pallas'")
    return _load_pallas("mosaic", kernels="mosaic")


register_backend("xla", _load_xla)
register_backend("cpu", _load_cpu)
register_backend("pallas", _load_pallas)
register_backend("mosaic", _load_mosaic)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str) -> str:
    """'auto' is pallas on GPU, the native kernels (cpu) on CPU where they build, else xla."""
    if name == "auto":
        platform = jax.default_backend()
        if platform == "gpu" and "pallas" in _BACKENDS:
            return "pallas"
        if platform == "cpu" and "cpu" in _BACKENDS and cpu_kernels_available():
            return "cpu"
        return "xla"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; available: {', '.join(['auto', *available_backends()])}")
    return name


def get_backend(name: str) -> AttentionBackend:
    return _BACKENDS[resolve_backend_name(name)]()


__all__ = ["AttentionBackend", "InStepWrite", "SeparateWrite", "available_backends", "get_backend",
           "register_backend", "resolve_backend_name"]
