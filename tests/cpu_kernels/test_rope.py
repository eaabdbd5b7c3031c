"""The native split of a joined q/k/v projection with RoPE (cpu_kernels/rope.cc) against the jnp path it replaces
(models.rope.apply_rotary on the sliced columns): full and partial rotary dims, grouped and plain heads, token counts
that do not fill the kernel's items; and the model's attention taking it on XLA CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not __import__("cpu_kernels.build").build.available(),
                                reason="needs a C++ compiler to build the native kernels")


def _reference(qkv: jax.Array, cos: jax.Array, sin: jax.Array, heads: int, kv_heads: int):
    from models.rope import apply_rotary

    tokens, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    q = qkv[:, :heads * hd].reshape(tokens, heads, hd)
    k = qkv[:, heads * hd:(heads + kv_heads) * hd].reshape(tokens, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd:].reshape(tokens, kv_heads, hd)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


@pytest.mark.parametrize("tokens, heads, kv_heads, hd, rotary", [
    (37, 9, 3, 64, 64), (1, 4, 4, 128, 128), (100, 4, 2, 64, 32), (17, 2, 1, 80, 80)])
def test_rope_qkv_matches_apply_rotary_on_the_split_columns(tokens, heads, kv_heads, hd, rotary):
    from cpu_kernels.rope import rope_qkv
    from models.rope import inverse_frequencies, rotary_tables

    rng = np.random.default_rng(tokens * hd + rotary)
    qkv = jnp.asarray(rng.standard_normal((tokens, (heads + 2 * kv_heads) * hd)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 4096, size=tokens), jnp.int32)
    cos, sin = rotary_tables(positions, inverse_frequencies(rotary, 10000.0, None))
    assert cos.shape == (tokens, rotary)
    got = jax.jit(lambda a, c, s: rope_qkv(a, c, s, heads, kv_heads))(qkv, cos, sin)
    want = jax.jit(lambda a, c, s: _reference(a, c, s, heads, kv_heads))(qkv, cos, sin)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6, err_msg=name)
    # the rotation moved q and k (the test would pass on a copy otherwise), and v is the columns as they are
    assert not np.allclose(np.asarray(got[0]), np.asarray(qkv[:, :heads * hd]).reshape(tokens, heads, hd))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))


def test_rope_qkv_refuses_a_width_that_is_not_whole_heads():
    from cpu_kernels.rope import rope_qkv

    qkv = jnp.zeros((4, 3 * 64 + 8), jnp.float32)
    cos = sin = jnp.zeros((4, 64), jnp.float32)
    with pytest.raises(Exception, match="rope_qkv"):
        jax.block_until_ready(jax.jit(lambda a, c, s: rope_qkv(a, c, s, 1, 1))(qkv, cos, sin))


def test_the_joined_projection_takes_the_native_rope_on_cpu():
    """A Llama attention with q, k and v joined lowers to the native call on XLA CPU, and gives the outputs of the
    jnp path (its _native_rope turned off) for the same weights."""
    from flax import nnx

    from models.config import ModelConfig
    from models.llama import Attention

    cfg = ModelConfig.from_hf_dict({"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})
    attn = Attention(cfg, jnp.float32, nnx.Rngs(0))
    assert attn.fuse_qkv()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)), jnp.float32)
    from models.rope import inverse_frequencies, rotary_tables

    cos, sin = rotary_tables(jnp.arange(5, dtype=jnp.int32), inverse_frequencies(16, 10000.0, None))
    native = jax.jit(lambda a, c, s: attn._rotated_qkv(a, c, s))
    assert "jvllm_rope_qkv" in native.lower(x, cos, sin).as_text()
    got = native(x, cos, sin)
    attn._native_rope = lambda *args: False
    want = jax.jit(lambda a, c, s: attn._rotated_qkv(a, c, s))(x, cos, sin)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
