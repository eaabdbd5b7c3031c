"""Pooling: reading sentence-transformers folders (legacy and new keys), resolving overrides, the pool maths."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from models.pooling import PoolingConfig, pool, read_sentence_transformers_config, resolve_pooling

ST = "sentence_transformers.models."


def st_folder(tmp_path, modules: list[str], pooling: dict | None = None, max_seq_length: int | None = 128):
    entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if kind == "Pooling" else "", "type": ST + kind}
               for i, kind in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if max_seq_length is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return tmp_path


@pytest.mark.parametrize("pooling, mode", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode": "max"}, "max"),
    ({"pooling_mode": ["mean_sqrt_len_tokens"]}, "mean_sqrt_len"),
])
def test_pooling_mode_is_read_from_legacy_and_new_keys(tmp_path, pooling, mode):
    config = read_sentence_transformers_config(st_folder(tmp_path, ["Transformer", "Pooling"], pooling))
    assert config.pooling == PoolingConfig(mode, normalize=False) and config.max_seq_length == 128


def test_a_normalize_module_turns_normalization_on_without_its_folder(tmp_path):
    config = read_sentence_transformers_config(
        st_folder(tmp_path, ["Transformer", "Pooling", "Normalize"], {"pooling_mode_cls_token": True}, None))
    assert config.pooling == PoolingConfig("cls", True) and config.max_seq_length is None


def test_no_modules_json_means_no_sentence_transformers_config(tmp_path):
    assert read_sentence_transformers_config(tmp_path) is None


@pytest.mark.parametrize("modules, pooling, message", [
    (["Transformer", "Pooling", "Dense"], {"pooling_mode": "mean"}, "Dense"),
    (["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "not supported"),
    (["Transformer", "Pooling"], {"pooling_mode": "weightedmean"}, "not supported"),
])
def test_modules_that_would_change_the_embedding_are_refused(tmp_path, modules, pooling, message):
    with pytest.raises(ValueError, match=message):
        read_sentence_transformers_config(st_folder(tmp_path, modules, pooling))


def test_overrides_win_and_defaults_follow_vllm(tmp_path):
    folder = read_sentence_transformers_config(
        st_folder(tmp_path, ["Transformer", "Pooling", "Normalize"], {"pooling_mode": "mean"}))
    assert resolve_pooling(folder, is_encoder=True, pooling=None, normalize=None) == PoolingConfig("mean", True)
    assert resolve_pooling(folder, is_encoder=True, pooling="cls", normalize=False) == PoolingConfig("cls", False)
    assert resolve_pooling(None, is_encoder=True, pooling=None, normalize=None) == PoolingConfig("cls", True)
    assert resolve_pooling(None, is_encoder=False, pooling=None, normalize=None) is None  # a causal LM: no embed
    assert resolve_pooling(None, is_encoder=False, pooling="last", normalize=None) == PoolingConfig("last", True)
    with pytest.raises(ValueError, match="needs pooling="):
        resolve_pooling(None, is_encoder=False, pooling=None, normalize=True)


def test_pool_modes_use_only_each_sequences_own_tokens():
    hidden = jnp.asarray(np.arange(12, dtype=np.float32).reshape(6, 2))  # [T=6, D=2], token t = [2t, 2t + 1]
    slots = jnp.asarray([0, 0, 3, 1, 1, 3])  # sequence 0: t0 t1; sequence 1: t3 t4; t2, t5 padding; slot 2 empty
    positions = jnp.asarray([0, 1, 0, 0, 1, 0])
    expected = {"mean": [[1, 2], [7, 8], [0, 0]], "cls": [[0, 1], [6, 7], [0, 0]], "last": [[2, 3], [8, 9], [0, 0]],
                "max": [[2, 3], [8, 9], [0, 0]],
                "mean_sqrt_len": [[2 / np.sqrt(2), 4 / np.sqrt(2)], [14 / np.sqrt(2), 16 / np.sqrt(2)], [0, 0]]}
    for mode, want in expected.items():
        np.testing.assert_allclose(pool(hidden, slots, positions, 3, mode), want, rtol=1e-6, err_msg=mode)
