"""HF tensors by name, including names that stand for derived tensors: every expert's tensor stacked (`EXPERT`),
or a row range of a fused projection (`row_range`, e.g. Phi-3's qkv_proj split into q, k and v)."""
from __future__ import annotations

from typing import Protocol

import numpy as np

EXPERT = "*"  # in an HF tensor name: every expert's index; the [out, in] tensors transposed and stacked [E, in, out]
_ROWS = "@rows="


class TensorSource(Protocol):
    """HF-named tensors read slice by slice."""

    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...
    def __contains__(self, name: str) -> bool: ...


class ArraySource:
    """In-memory HF-named numpy arrays."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self._tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self._tensors[name][index])


def expert_names(name: str, num_experts: int) -> list[str]:
    return [name.replace(EXPERT, str(e)) for e in range(num_experts)]


def row_range(name: str, start: int, stop: int) -> str:
    """The name of rows [start, stop) of tensor `name` (a fused [out, in] projection)."""
    return f"{name}{_ROWS}{start}:{stop}"


class DerivedTensors:
    """A source that also answers stacked expert names and row ranges, reading only the slices a block needs.
    Names the source holds as they are (e.g. arrays built under those names) are read directly."""

    def __init__(self, source: TensorSource, num_experts: int = 0):
        self._source, self._num_experts = source, num_experts

    def _kind(self, name: str) -> str:
        if name in self._source:
            return "plain"
        if _ROWS in name:
            return "rows"
        return "experts" if EXPERT in name else "plain"

    def _rows(self, name: str) -> tuple[str, int, int]:
        base, span = name.split(_ROWS)
        start, stop = (int(x) for x in span.split(":"))
        return base, start, stop

    def __contains__(self, name: str) -> bool:
        kind = self._kind(name)
        if kind == "rows":
            return self._rows(name)[0] in self._source
        if kind == "experts":
            return name.replace(EXPERT, "0") in self._source
        return name in self._source

    def source_name(self, name: str) -> str:
        """The stored tensor a name reads from (for error messages)."""
        kind = self._kind(name)
        return self._rows(name)[0] if kind == "rows" else name.replace(EXPERT, "0") if kind == "experts" else name

    def shape(self, name: str) -> tuple[int, ...]:
        kind = self._kind(name)
        if kind == "rows":
            base, start, stop = self._rows(name)
            return (stop - start, *self._source.shape(base)[1:])
        if kind == "experts":
            return (self._num_experts, *self._source.shape(name.replace(EXPERT, "0"))[::-1])
        return self._source.shape(name)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        kind = self._kind(name)
        if kind == "rows":
            base, start, _ = self._rows(name)
            return self._source.read(base, (slice(start + index[0].start, start + index[0].stop), *index[1:]))
        if kind == "experts":
            experts = range(*index[0].indices(self._num_experts))
            names = expert_names(name, self._num_experts)
            return np.stack([self._source.read(names[e], index[:0:-1]).T for e in experts])
        return self._source.read(name, index)

    def whole(self, name: str) -> np.ndarray:
        return self.read(name, tuple(slice(0, size) for size in self.shape(name)))
