"""A second engine in one process reuses the first one's executables, and only where the module, devices and
argument structure are the same."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jvllm import Engine, SamplingParams
from jvllm.worker import executable_memo


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


def test_a_second_engine_of_the_same_model_compiles_nothing_and_generates_the_same(tiny_model_factory):
    folder = str(tiny_model_factory("llama"))
    settings = dict(max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["the river ran", "a door opened under the"]
    first = Engine(folder, **settings)
    want = [o.outputs[0].token_ids for o in first.generate(prompts, params)]
    hits = executable_memo.hits
    second = Engine(folder, **settings)
    assert executable_memo.hits - hits >= second.runner.compiled.count
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params)] == want
