"""Exported step pieces: a piece lowered from its stored module computes what the traced piece computes, keeps its
donations, and anything the path cannot take falls back to tracing."""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.sample.logprobs import LogprobStats
from jvllm.worker import executable_memo
from jvllm.worker import exported_pieces as pieces_module
from jvllm.worker.exported_pieces import exported_pieces


def _piece(weights, pages, x, *, groups=(0,)):
    """A step piece's kinds of inputs and outputs: a donated list of pages, a registered dataclass, a static arg."""
    stats = LogprobStats(x.sum(-1), jnp.argmax(x, -1).astype(jnp.int32), jnp.zeros((x.shape[0], 2), jnp.int32),
                         x[:, :2])
    return [p + len(groups) for p in pages], {"stats": stats, "y": x @ weights}


PIECE = jax.jit(_piece, donate_argnames=("pages",), static_argnames=("groups",))


def _inputs(scale: float = 1.0):
    weights = jnp.arange(12.0).reshape(4, 3) * scale
    return weights, [jnp.zeros(8), jnp.ones(8)], jnp.arange(8.0).reshape(2, 4) * scale


def _run(compiled, scale: float = 1.0):
    return jax.tree.map(np.asarray, compiled(*_inputs(scale)))


def test_a_stored_piece_computes_what_the_traced_piece_computes_and_keeps_its_donations(tmp_path):
    expected = PIECE.lower(*_inputs(), groups=(0, 1)).compile()
    for round_ in range(2):  # exported and stored, then read back by a new start's store
        store = exported_pieces(tmp_path, "engine A")
        lowered = store.lower("piece", PIECE, _inputs(), {"groups": (0, 1)})
        assert (store.stored, store.loaded, store.plain) == ((1, 0, 0) if round_ == 0 else (0, 1, 0))
        assert [a.donated for a in jax.tree.leaves(lowered.args_info)] == [False, True, True, False]
        compiled = lowered.compile()
        assert compiled.out_info == expected.out_info
        for scale in (1.0, -0.5):  # a stored module computes from its arguments, not from the example's values
            got, want = _run(compiled, scale), _run(expected, scale)
            assert jax.tree.structure(got) == jax.tree.structure(want)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(a, b)


def test_other_arguments_or_static_values_or_engines_get_pieces_of_their_own(tmp_path):
    store = exported_pieces(tmp_path, "engine A")
    store.lower("piece", PIECE, _inputs(), {"groups": (0, 1)})
    store.lower("piece", PIECE, _inputs(), {"groups": (0,)})
    wide = (jnp.ones((4, 5)), [jnp.zeros(8), jnp.ones(8)], jnp.ones((2, 4)))
    store.lower("piece", PIECE, wide, {"groups": (0,)})
    assert store.stored == 3
    other = exported_pieces(tmp_path, "engine B")
    other.lower("piece", PIECE, _inputs(), {"groups": (0, 1)})
    assert other.stored == 1 and other.folder != store.folder


def test_a_later_engine_of_the_process_takes_the_executable_compiled_from_the_same_stored_module(tmp_path):
    executable_memo.clear()
    first = exported_pieces(tmp_path, "engine A")
    compiled = first.compile("piece", PIECE, _inputs(), {"groups": (0, 1)})
    assert (first.stored, first.reused) == (1, 0)
    again = exported_pieces(tmp_path, "engine A")
    assert again.compile("piece", PIECE, _inputs(), {"groups": (0, 1)}) is compiled
    assert (again.stored, again.loaded, again.reused) == (0, 0, 1)  # neither read nor lowered
    want = PIECE.lower(*_inputs(), groups=(0, 1)).compile()
    np.testing.assert_array_equal(_run(compiled)[1]["y"], _run(want)[1]["y"])
    other = exported_pieces(tmp_path, "engine B")  # another engine's description: exported and lowered for it
    other.compile("piece", PIECE, _inputs(), {"groups": (0, 1)})
    assert (other.stored, other.reused) == (1, 0)
    assert again.compile("piece", PIECE, _inputs(), {"groups": (0,)}) is not compiled  # other static arguments
    executable_memo.clear()  # the memo let go (memory maps): the stored module is read and lowered again
    later = exported_pieces(tmp_path, "engine A")
    assert later.compile("piece", PIECE, _inputs(), {"groups": (0, 1)}) is not compiled
    assert (later.loaded, later.reused) == (1, 0)


def test_a_setting_of_the_environment_or_of_jax_gets_an_engine_folder_of_its_own(tmp_path, monkeypatch):
    plain = exported_pieces(tmp_path, "engine A").folder
    monkeypatch.setenv("JVLLM_LAYERS_PER_CALL", "3")
    with_variable = exported_pieces(tmp_path, "engine A").folder
    with jax.default_matmul_precision("highest"):
        with_precision = exported_pieces(tmp_path, "engine A").folder
    assert len({plain, with_variable, with_precision}) == 3


def test_a_damaged_file_is_exported_again(tmp_path):
    exported_pieces(tmp_path, "engine A").lower("piece", PIECE, _inputs(), {"groups": (0,)})
    (stored,) = (tmp_path / next(p.name for p in tmp_path.iterdir())).iterdir()
    stored.write_bytes(b"not a module")
    store = exported_pieces(tmp_path, "engine A")
    compiled = store.lower("piece", PIECE, _inputs(), {"groups": (0,)}).compile()
    assert (store.stored, store.loaded) == (1, 0)
    np.testing.assert_array_equal(_run(compiled)[1]["y"], _run(PIECE.lower(*_inputs()).compile())[1]["y"])


def test_pieces_with_settings_a_plain_call_would_lose_are_traced(tmp_path):
    sharded = jax.jit(_piece, static_argnames=("groups",), out_shardings=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))
    store = exported_pieces(tmp_path, "engine A")
    assert store.lower("piece", sharded, _inputs(), {}) is None
    assert store.lower("piece", lambda *a: a, _inputs(), {}) is None  # not a jax.jit function
    assert (store.plain, store.stored) == (2, 0)


def test_the_least_recently_used_engines_are_forgotten(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces_module, "KEPT_ENGINES", 2)
    folders = [exported_pieces(tmp_path, f"engine {i}").folder for i in range(2)]
    for age, folder in zip((100, 50), folders):  # engine 0 used longest ago
        os.utime(folder, (time.time() - age, time.time() - age))
    folders.append(exported_pieces(tmp_path, "engine 2").folder)
    assert not folders[0].exists() and folders[1].exists() and folders[2].exists()


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_switch_turns_the_store_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv(pieces_module.SWITCH, value)
    assert exported_pieces(tmp_path, "engine A") is None

