"""The GGUF header index: a header rebuilt from it reads the same fields, tensor table and bytes as gguf's parsed
header, later starts do not parse the file, and an index that is missing, damaged or of another file is rebuilt."""
from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest

from jvllm.model_loader import gguf_index
from jvllm.model_loader.gguf import open_gguf
from jvllm.model_loader.gguf_blocks import read_gguf_weights
from jvllm.model_loader.gguf_index import IndexedHeader, indexed_gguf

VOCAB = [f"token{i}" for i in range(gguf_index.MAX_INDEXED_ITEMS + 50)]


@pytest.fixture
def small_gguf(tmp_path) -> str:
    """A file with scalar, string, small-array and vocabulary-sized fields, and F32, F16, Q8_0 and 1-D tensors."""
    rng = np.random.default_rng(0)
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_rope_freq_base(10000.5)
    writer.add_bool("test.flag", True)
    writer.add_array("test.small", [1, 2, 3])
    writer.add_token_list(VOCAB)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 32)).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((4, 32)).astype(np.float16))
    q8_rows = rng.integers(0, 256, (4, 34), dtype=np.uint8)  # 4 rows of one Q8_0 block (34 bytes) each
    writer.add_tensor("blk.0.ffn_up.weight", q8_rows, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _same_header(indexed, parsed) -> None:
    assert isinstance(indexed, IndexedHeader)
    assert indexed.arch == parsed.arch
    for key in parsed.reader.fields:
        if not key.startswith("GGUF."):
            assert indexed.field(key) == parsed.field(key), key
    assert list(indexed.tensors) == list(parsed.tensors)
    for name, tensor in parsed.tensors.items():
        mine = indexed.tensors[name]
        assert mine.tensor_type == tensor.tensor_type
        assert mine.shape == tuple(int(d) for d in tensor.shape)
        assert mine.data.dtype == tensor.data.dtype and mine.data.shape == tensor.data.shape
        np.testing.assert_array_equal(mine.data, tensor.data)
        assert indexed.shape(name) == parsed.shape(name)


def test_an_indexed_header_reads_what_the_parsed_header_reads(small_gguf, tmp_path):
    index_file = tmp_path / "index.json"
    parsed = indexed_gguf(small_gguf, index_file)  # no index yet: parsed, and the index written
    assert not isinstance(parsed, IndexedHeader)
    index = json.loads(index_file.read_text())
    assert index["omitted"] == ["tokenizer.ggml.tokens"]  # the vocabulary stays out of the index
    _same_header(indexed_gguf(small_gguf, index_file), parsed)


def test_a_later_start_does_not_parse_the_file_until_an_omitted_field_is_asked_for(small_gguf, tmp_path, monkeypatch):
    index_file = tmp_path / "index.json"
    indexed_gguf(small_gguf, index_file)
    parses: list[str] = []
    monkeypatch.setattr(gguf_index, "open_gguf", lambda path: parses.append(path) or open_gguf(path))
    header = indexed_gguf(small_gguf, index_file)
    assert header.arch == "llama" and header.field("test.small") == [1, 2, 3] and header.field("missing", 7) == 7
    assert parses == []
    assert header.field("tokenizer.ggml.tokens") == VOCAB
    assert parses == [small_gguf]


@pytest.mark.parametrize("damage", ["not json", "other file", "other version", "missing keys"])
def test_a_damaged_or_foreign_index_is_rebuilt(small_gguf, tmp_path, damage):
    index_file = tmp_path / "index.json"
    indexed_gguf(small_gguf, index_file)
    index = json.loads(index_file.read_text())
    if damage == "not json":
        index_file.write_text("{")
    else:
        if damage == "other file":
            index["size"] += 1
        elif damage == "other version":
            index["version"] += 1
        else:
            del index["tensors"]
        index_file.write_text(json.dumps(index))
    header = indexed_gguf(small_gguf, index_file)
    assert not isinstance(header, IndexedHeader) and header.arch == "llama"
    assert json.loads(index_file.read_text()) == json.loads(json.dumps(gguf_index.header_index(header, small_gguf)))
    _same_header(indexed_gguf(small_gguf, index_file), header)


def test_an_unwritable_index_folder_still_loads(small_gguf, tmp_path):
    header = indexed_gguf(small_gguf, tmp_path / "no such folder" / "index.json")
    assert header.arch == "llama" and len(header.tensors) == 4


def test_the_embedded_model_loads_the_same_weights_through_its_index(tmp_path):
    from jvllm.model_loader.default_model import default_model_path

    path = default_model_path()
    index_file = tmp_path / "index.json"
    parsed = indexed_gguf(path, index_file)
    indexed = indexed_gguf(path, index_file)
    _same_header(indexed, parsed)
    expected, got = read_gguf_weights(parsed), read_gguf_weights(indexed)
    assert list(got.blocks) == list(expected.blocks) and list(got.floats) == list(expected.floats)
    for name, (raw, fmt) in expected.blocks.items():
        assert got.blocks[name][1] == fmt
        np.testing.assert_array_equal(got.blocks[name][0], raw)
    for name, array in expected.floats.items():
        np.testing.assert_array_equal(got.floats[name], array)
    assert pathlib.Path(index_file).stat().st_size < 100_000  # the vocabulary is not in it
