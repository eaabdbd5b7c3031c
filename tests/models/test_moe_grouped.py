"""The CPU expert loop (models.moe.expert_mlp_tiles) and the Pallas kernel's products (expert_mlp_pallas, interpret
mode) give jax.lax.ragged_dot's result for any routing; which one runs where."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe
from models.moe import expert_mlp_pallas, expert_mlp_ragged, expert_mlp_tiles, tile_rows


def _expert_inputs(sizes: list[int], width: int, hidden: int, seed: int) -> tuple[jax.Array, ...]:
    """Random (rows [sum(sizes), width], gate and up [E, width, hidden], down [E, hidden, width], group sizes [E])."""
    rng = np.random.default_rng(seed)
    experts = len(sizes)
    rows = jnp.asarray(rng.standard_normal((sum(sizes), width)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((experts, width, hidden)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((experts, hidden, width)), jnp.float32)
    return rows, gate, up, down, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("sizes", [[5, 0, 20, 7], [0, 0, 2, 0], [1, 1], [64, 0, 0, 0, 0, 0, 0, 1], [3] * 16])
def test_tiles_match_ragged_dot(sizes):
    inputs = _expert_inputs(sizes, width=32, hidden=24, seed=sum(sizes))
    got = jax.jit(expert_mlp_tiles)(*inputs)
    want = expert_mlp_ragged(*inputs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_tile_rows_follow_the_average_share():
    assert tile_rows(2, 8) == 8  # a decode row's two choices: the smallest tile
    assert tile_rows(128, 8) == 8  # 64 decode rows, top-2 of 8 experts: 16 rows each on average
    assert tile_rows(1024, 8) == 64
    assert tile_rows(1 << 16, 8) == 128


@pytest.mark.parametrize("sizes", [[5, 0, 20, 7], [0, 0, 2, 0], [1, 1], [3] * 16])
@pytest.mark.parametrize("width, hidden", [(32, 48), (24, 40)], ids=["aligned", "padded"])
def test_pallas_products_match_ragged_dot(sizes, width, hidden, monkeypatch):
    """The grouped-matmul kernel (interpret mode) for gate, up and down; widths off the kernel's multiple of 16
    are zero-padded inside and give the same result."""
    monkeypatch.delenv("JVLLM_PALLAS_INTERPRET", raising=False)
    inputs = _expert_inputs(sizes, width, hidden, seed=len(sizes) + width)
    got = jax.jit(expert_mlp_pallas)(*inputs)
    want = expert_mlp_ragged(*inputs)
    assert got.shape == want.shape == (sum(sizes), width)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend, chosen", [("gpu", "pallas"), ("cpu", "tiles"), ("tpu", "ragged")])
def test_implementation_follows_the_backend_unless_forced(backend, chosen, monkeypatch):
    monkeypatch.delenv(moe.EXPERTS_ENV, raising=False)
    monkeypatch.setattr(moe.jax, "default_backend", lambda: backend)
    assert moe.expert_implementation() == chosen
    monkeypatch.setenv(moe.EXPERTS_ENV, "pallas")
    assert moe.expert_implementation() == "pallas"


def test_expert_split_axis_is_the_meshs_tensor_parallel_axis():
    """models.moe names the mesh axis itself (models import nothing of jvllm); it must be the one the
    engine's rule table splits the experts' intermediate width over."""
    from jvllm.parallel.mesh import LOGICAL_AXIS_RULES

    assert LOGICAL_AXIS_RULES["expert_mlp"] == moe.TP_AXIS
