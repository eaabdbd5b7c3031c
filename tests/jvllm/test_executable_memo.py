"""A second engine in one process reuses the first one's executables, and only where the module, devices and
argument structure are the same."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import Engine, SamplingParams
from jvllm.worker import executable_memo, exported_pieces


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tagged:
    value: jax.Array
    tag: bool = dataclasses.field(metadata=dict(static=True))  # pytree metadata that leaves the module unchanged


def test_equal_modules_share_an_executable_only_with_equal_argument_structure():
    double = jax.jit(lambda t: t.value * 2)
    again = jax.jit(lambda t: t.value * 2)  # another function object: what a second engine traces
    x = jnp.arange(4.0)
    first = executable_memo.compile_once(double.lower(Tagged(x, True)))
    assert executable_memo.compile_once(again.lower(Tagged(x, True))) is first
    other = executable_memo.compile_once(again.lower(Tagged(x, False)))
    assert other is not first
    np.testing.assert_array_equal(other(Tagged(x, False)), 2 * np.arange(4.0))
    assert executable_memo.compile_once(jax.jit(lambda t: t.value * 3).lower(Tagged(x, True))) is not first


def test_a_module_named_by_the_caller_is_found_by_its_name_not_by_its_text():
    x = jnp.arange(4.0)
    named = executable_memo.compile_once(jax.jit(lambda v: v * 4).lower(x), module="stored module A")
    assert executable_memo.compile_once(jax.jit(lambda v: v * 4).lower(x), module="stored module A") is named
    assert executable_memo.compile_once(jax.jit(lambda v: v * 4).lower(x), module="stored module B") is not named
    assert executable_memo.compile_once(jax.jit(lambda v: v * 4).lower(x)) is not named  # by its text: its own key
    np.testing.assert_array_equal(named(x), 4 * np.arange(4.0))


def test_an_unread_argument_of_another_shape_gets_its_own_executable():
    """jit prunes arguments a computation never reads from the module; the executable still checks them."""
    def first_only(a, unread):
        return a + 1

    x = jnp.arange(3.0)
    narrow = executable_memo.compile_once(jax.jit(first_only).lower(x, jnp.zeros((1, 16), jnp.int32)))
    wide = executable_memo.compile_once(jax.jit(first_only).lower(x, jnp.zeros((1, 32), jnp.int32)))
    assert wide is not narrow
    np.testing.assert_array_equal(wide(x, jnp.zeros((1, 32), jnp.int32)), np.arange(3.0) + 1)


@pytest.mark.parametrize("exported", [False, True], ids=["traced", "exported_pieces"])
def test_a_second_engine_of_the_same_model_compiles_nothing_and_generates_the_same(tiny_model_factory, tmp_path,
                                                                                   monkeypatch, exported):
    # a process near its memory-map limit empties the memo before compiling (tested below); not here
    monkeypatch.setattr(executable_memo, "_keep_maps_in_bounds", lambda: None)
    if exported:  # on, as outside the tests: the second engine takes each piece by its stored module, unlowered
        monkeypatch.setattr(exported_pieces, "exported_pieces_root", lambda: tmp_path)
    folder = str(tiny_model_factory("llama"))
    settings = dict(max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["the river ran", "a door opened under the"]
    first = Engine(folder, **settings)
    want = [o.outputs[0].token_ids for o in first.generate(prompts, params)]
    hits = executable_memo.hits
    second = Engine(folder, **settings)
    assert executable_memo.hits - hits >= second.runner.compiled.count
    # the sampler's jitted function is shared, so its tracing and lowering were not done again either
    assert second.runner.compiled.steps.pick is first.runner.compiled.steps.pick
    pieces = second.runner.compiled.exported
    if exported:
        assert first.runner.compiled.exported.stored > 0 and pieces.folder == first.runner.compiled.exported.folder
        assert (pieces.reused, pieces.loaded, pieces.stored, pieces.plain) == (second.runner.compiled.count, 0, 0, 0)
        third = Engine(folder, **settings, max_num_batched_tokens=64, precompile=False)  # other shapes: own pieces
        assert third.runner.compiled.exported.folder != pieces.folder
    else:
        assert pieces is None
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params)] == want


def test_an_executable_kept_under_two_keys_counts_once_against_the_capacity(monkeypatch):
    executable_memo.clear()
    monkeypatch.setattr(executable_memo, "capacity", lambda: 2)
    a, b, c = (executable_memo.compile_once(jax.jit(lambda x, k=k: x * k).lower(jnp.arange(3.0))) for k in (5, 6, 7))
    executable_memo.clear()
    executable_memo.remember(("text", 1), a)
    executable_memo.remember(("piece", 1), a)  # the same executable found by its stored module
    executable_memo.remember(("text", 2), b)
    assert [executable_memo.remembered(k) for k in (("text", 1), ("piece", 1), ("text", 2))] == [a, a, b]
    executable_memo.remember(("text", 3), c)  # a third executable: the least recently used one's keys go
    assert executable_memo.remembered(("text", 1)) is None and executable_memo.remembered(("piece", 1)) is None
    assert executable_memo.remembered(("text", 2)) is b and executable_memo.remembered(("text", 3)) is c


def test_near_the_map_limit_the_memo_lets_go_and_warns(monkeypatch, caplog):
    executable_memo.compile_once(jax.jit(lambda x: x - 1).lower(jnp.arange(3.0)))
    assert len(executable_memo._memo) > 0
    used = executable_memo.maps_in_use()
    assert used is not None and used > 100  # Linux: the process's own maps are counted
    monkeypatch.setattr(executable_memo, "max_map_count", lambda: 1000)  # past it, even after collecting garbage
    monkeypatch.setattr(executable_memo, "_warned", False)
    monkeypatch.setattr(executable_memo, "_next_reclaim", 0)
    assert executable_memo.capacity() >= 16
    with caplog.at_level("WARNING", logger="jvllm"):
        compiled = executable_memo.compile_once(jax.jit(lambda x: x - 2).lower(jnp.arange(3.0)))
    np.testing.assert_array_equal(compiled(jnp.arange(3.0)), np.arange(3.0) - 2)
    assert len(executable_memo._memo) == 1  # emptied before this compile, then holding it alone
    assert "vm.max_map_count" in caplog.text


def test_the_maps_are_counted_only_where_the_compiles_since_could_reach_the_reclaim_line(monkeypatch):
    counts, held = [], {"maps": 1000}

    def counting() -> int:
        counts.append(held["maps"])
        return held["maps"]

    monkeypatch.setattr(executable_memo, "maps_in_use", counting)
    monkeypatch.setattr(executable_memo, "max_map_count", lambda: 65530)  # the reclaim line at 32,765 maps
    monkeypatch.setattr(executable_memo, "_next_reclaim", 0)
    monkeypatch.setattr(executable_memo, "_counted", None)
    monkeypatch.setattr(executable_memo, "_compiles_since_count", 0)
    for _ in range(1 + executable_memo.RECOUNT_EVERY):
        executable_memo._keep_maps_in_bounds()
    assert counts == [1000]  # the first compile counts; the next ones cannot have reached the line
    executable_memo._keep_maps_in_bounds()
    assert counts == [1000, 1000]  # counted again after RECOUNT_EVERY compiles (maps also come from elsewhere)
    held["maps"] = 31_000
    monkeypatch.setattr(executable_memo, "_counted", None)
    executable_memo._keep_maps_in_bounds()
    bound = executable_memo.MAPS_PER_COMPILE_BOUND
    skipped = (32_765 - 31_000) // bound  # compiles after which the line is still out of reach
    for _ in range(skipped):
        executable_memo._keep_maps_in_bounds()
    assert len(counts) == 3
    executable_memo._keep_maps_in_bounds()
    assert len(counts) == 4
