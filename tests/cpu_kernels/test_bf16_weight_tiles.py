"""Products of many rows with bfloat16 weights in bf16 tiles (cpu_kernels.bf16_rows.bf16_tiles_product) against
float64 products of the bf16-rounded rows and weights; which products of a model take them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_kernels.bf16_rows import BF16_X_TILES_MAX_ROWS, bf16_tiles_available, bf16_tiles_product
from models.bf16_rows import TILES_MAX_IN_OUT_DEPTH, TILES_MAX_OUTPUTS, bf16_rows_dot, native_bf16_rows
from models.layers import Linear
from models.live_rows import live_rows


def _product(x: jax.Array, w: jax.Array, out_in: bool, live: int) -> np.ndarray:
    return np.asarray(jax.jit(lambda a, b, n: bf16_tiles_product(a, b, out_in, n))(x, w, jnp.int32(live)))


@pytest.mark.parametrize("rows, live", [(5, 5), (12, 12), (13, 13), (32, 29), (48, 48), (64, 50), (300, 297), (16, 0)])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 17), (32, 1), (96, 40), (2048, 33)])
@pytest.mark.parametrize("out_in", [False, True], ids=["in_out", "out_in"])
def test_products_are_the_bf16_rounded_rows_times_the_weights(rows, live, k, n, out_in):
    """Row counts around the tiles' groups of 12 rows and, for [N, K] weights up to BF16_X_TILES_MAX_ROWS live rows,
    the x tiles' vectors of 16 rows; outputs around their 8-, 16- and 32-column passes (partial ones too), depths
    over a 512-pair slice: the live rows within float32 summation of the exact products of x rounded to bf16 with
    the weights, the padding rows 0."""
    rng = np.random.default_rng(k * n + rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)  # [K, N]
    if not bf16_tiles_available():  # no AVX-512 BF16: the kernel refuses, and models keep XLA's dot
        with pytest.raises(Exception, match="no AVX-512 BF16"):
            _product(x, w.T if out_in else w, out_in, live)
        return
    got = _product(x, w.T if out_in else w, out_in, live)
    x16 = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    want, magnitude = x16 @ w64, np.abs(x16) @ np.abs(w64)
    assert got.shape == (rows, n) and got.dtype == np.float32
    assert np.all(np.abs(got[:live] - want[:live]) <= 4 * k * 2.0 ** -24 * magnitude[:live] + 1e-30)
    assert np.all(got[live:] == 0.0)


def test_a_depth_that_is_not_whole_32_value_chunks_is_refused():
    x = jnp.ones((8, 48), jnp.float32)
    with pytest.raises(Exception, match="multiple of 32|no AVX-512 BF16"):
        jax.block_until_ready(bf16_tiles_product(x, jnp.ones((48, 16), jnp.bfloat16), False))


def _lowered(layer: Linear, rows: int, d_in: int, enabled: bool) -> str:
    x = jnp.ones((rows, d_in), jnp.float32)
    with native_bf16_rows(enabled):
        return jax.jit(lambda a: layer(a)).lower(x).as_text()


@pytest.mark.parametrize("d_in, d_out, tiles", [
    (64, 160, True), (160, 64, True),  # [K, N] and, narrowing, [N, K] as the batched copy stores it
    (TILES_MAX_IN_OUT_DEPTH + 32, 64, True), (TILES_MAX_IN_OUT_DEPTH + 32, TILES_MAX_IN_OUT_DEPTH + 64, False),
    (64, TILES_MAX_OUTPUTS + 32, False), (48, 64, False)])
def test_a_linear_of_many_rows_takes_the_tiles_where_they_are_the_faster_product(d_in, d_out, tiles):
    """5+ rows with bf16 weights inside native_bf16_rows(True): the tiles for [N, K] weights and for [K, N] ones up
    to TILES_MAX_IN_OUT_DEPTH, at most TILES_MAX_OUTPUTS outputs and K a multiple of 32; XLA's dot otherwise,
    and always outside it."""
    layer = Linear(d_in, d_out, bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if d_in > d_out:
        layer.kernel = nnx.Param(layer.kernel[...].T)
    assert ("jvllm_bf16_tiles" in _lowered(layer, 8, d_in, True)) == (tiles and bf16_tiles_available())
    assert "jvllm_bf16_tiles" not in _lowered(layer, 8, d_in, False)


@pytest.mark.parametrize("rows, tiles", [(8, True), (BF16_X_TILES_MAX_ROWS, True), (BF16_X_TILES_MAX_ROWS + 1, False)])
def test_a_wide_out_in_head_takes_the_tiles_for_few_rows_only(rows, tiles):
    """A [V, D] head wider than TILES_MAX_OUTPUTS (a tied embedding table) is read in place against tiles of x for
    up to BF16_X_TILES_MAX_ROWS rows; for more rows each call would move it into tiles, so XLA's dot takes it. The
    logits are XLA's bf16 product within float32 summation either way."""
    rng = np.random.default_rng(rows)
    table = jnp.asarray(rng.standard_normal((TILES_MAX_OUTPUTS + 72, 64)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)

    def xla(a: jax.Array) -> jax.Array:
        return jnp.einsum("sd,vd->sv", a.astype(table.dtype), table, preferred_element_type=jnp.float32)

    def head(a: jax.Array) -> jax.Array:
        with native_bf16_rows(True):
            y = bf16_rows_dot(a, table, out_in=True)
        return xla(a) if y is None else y

    assert ("jvllm_bf16_tiles" in jax.jit(head).lower(x).as_text()) == (tiles and bf16_tiles_available())
    np.testing.assert_allclose(np.asarray(jax.jit(head)(x)), np.asarray(jax.jit(xla)(x)), rtol=1e-5, atol=1e-4)


def test_a_layer_skips_the_steps_padding_rows():
    """Inside live_rows (a step's real tokens first), the product of the tiles leaves the padding rows 0 and gives
    the live ones XLA's bf16 product within float32 summation."""
    layer = Linear(128, 96, bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((16, 128)), jnp.float32)

    def run(a: jax.Array) -> jax.Array:
        with native_bf16_rows(True), live_rows(jnp.int32(11), 16):
            return layer(a)

    got = np.asarray(jax.jit(run)(x))
    want = np.asarray(jnp.einsum("td,de->te", x.astype(jnp.bfloat16), layer.kernel[...],
                                 preferred_element_type=jnp.float32))
    if bf16_tiles_available():
        assert np.all(got[11:] == 0.0)
        np.testing.assert_allclose(got[:11], want[:11], rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
