"""A GGUF file's header kept as a small JSON index (its scalar fields and tensor table), so that later starts map the
tensors without parsing the header again: gguf's reader builds an object per vocabulary string (the embedded model's
98k strings and merges: ~0.5 s each start), which the weights do not need."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from jvllm.model_loader.gguf import open_gguf
from jvllm.model_loader.gguf_arch import GGUFHeader

logger = logging.getLogger("jvllm")

INDEX_VERSION = 1
# Array fields longer than this (the vocabulary, its merges, scores and types) stay out of the index; asking an
# indexed header for one parses the file then.
MAX_INDEXED_ITEMS = 256
INDEX_FILE = "gguf_index.json"  # in the converted folder, beside the config and tokenizer


class IndexedTensor(NamedTuple):
    """What the loaders read of gguf's ReaderTensor: the same name, type, shape (GGUF order) and data view."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class IndexedHeader(GGUFHeader):
    """A header rebuilt from its index over a fresh memory map of the file; `reader` and the fields left out of
    the index come from parsing the file, on first use."""

    def __init__(self, path: str, index: dict[str, Any]):
        self._path = path
        self._fields: dict[str, Any] = index["fields"]
        self._omitted = set(index["omitted"])
        self._parsed: GGUFHeader | None = None
        mapped = np.memmap(path, mode="r").view(np.ndarray)  # the view keeps the map alive
        self.tensors: dict[str, IndexedTensor] = {}  # type: ignore[assignment]
        for name, type_id, dims, dtype, shape, offset in index["tensors"]:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            data = mapped[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
            self.tensors[name] = IndexedTensor(name, gguf.GGMLQuantizationType(type_id), tuple(dims), data)
        self.arch = self.field("general.architecture")

    @property
    def reader(self) -> gguf.GGUFReader:  # type: ignore[override]
        return self._full().reader

    def field(self, key: str, default: Any = None) -> Any:
        if key in self._omitted:
            return self._full().field(key, default)
        return self._fields.get(key, default)

    def _full(self) -> GGUFHeader:
        if self._parsed is None:
            self._parsed = open_gguf(self._path)
        return self._parsed


def header_index(header: GGUFHeader, path: str) -> dict[str, Any]:
    """A parsed header -> its index (JSON-ready)."""
    fields: dict[str, Any] = {}
    omitted: list[str] = []
    for key, field in header.reader.fields.items():
        if key.startswith("GGUF."):  # the file's own framing (version, counts), not metadata
            continue
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > MAX_INDEXED_ITEMS:
            omitted.append(key)
        else:
            fields[key] = field.contents()
    tensors = [[t.name, int(t.tensor_type), [int(d) for d in t.shape], t.data.dtype.str, list(t.data.shape),
                int(t.data_offset)] for t in header.reader.tensors]
    return {"version": INDEX_VERSION, "size": os.path.getsize(path), "fields": fields, "omitted": omitted,
            "tensors": tensors}


def write_index(header: GGUFHeader, path: str, index_file: Path) -> None:
    """`header`'s index into `index_file`, atomically; a folder that cannot be written only costs a parse later."""
    try:
        partial = index_file.with_name(f"{index_file.name}.tmp{os.getpid()}")
        partial.write_text(json.dumps(header_index(header, path)))
        os.replace(partial, index_file)
    except OSError as error:
        logger.info("could not write the GGUF index %s (%s)", index_file, error)


def indexed_gguf(path: str, index_file: Path) -> GGUFHeader:
    """The file's header: from `index_file` when it holds this file's index, else parsed (and the index written
    there for the next start)."""
    try:
        index = json.loads(index_file.read_text())
        if index.get("version") == INDEX_VERSION and index.get("size") == os.path.getsize(path):
            return IndexedHeader(path, index)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as error:  # unreadable or from another version: rebuilt
        logger.info("rebuilding the GGUF index %s (%s)", index_file, error)
    header = open_gguf(path)
    write_index(header, path, index_file)
    return header
