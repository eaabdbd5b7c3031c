"""The native encoder attention (cpu_kernels.encoder): attention within the sequences packed into each row, against
the BERT model's jnp attention over the whole row, masked."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_kernels.encoder import segment_attention
from models.bert import attention_bias


def jnp_attention(qkv: jax.Array, segments: jax.Array, bias: jax.Array, heads: int) -> jax.Array:
    """The masked attention over the whole row of the biased q, k and v, as models.bert computes it without the
    kernel."""
    rows, width, packed = qkv.shape
    head_dim = packed // (3 * heads)
    q, k, v = (qkv + bias).reshape(rows, width, 3, heads, head_dim).transpose(2, 0, 3, 1, 4)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * head_dim ** -0.5 + attention_bias(segments)[:, None]
    weights = jnp.exp(scores - scores.max(-1, keepdims=True))
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, v) / weights.sum(-1, keepdims=True)
    return out.transpose(0, 2, 1, 3).reshape(rows, width, -1)


def packed_segments(rng: np.random.Generator, rows: int, width: int, longest: int) -> np.ndarray:
    """Rows of consecutive sequences (1, 2, ...) of 1..longest tokens, each row's tail left as padding (0)."""
    segments = np.zeros((rows, width), np.int32)
    for row in range(rows):
        start, number = 0, 1
        while start < width - 2:
            length = int(rng.integers(1, longest + 1))
            segments[row, start:start + length] = number
            start, number = start + length, number + 1
    return segments


def check(qkv: jax.Array, segments: jax.Array, bias: jax.Array, heads: int) -> None:
    got = np.asarray(jax.jit(lambda a, s, b: segment_attention(a, s, b, heads))(qkv, segments, bias))
    real = np.asarray(segments) > 0
    want = np.asarray(jnp_attention(qkv, segments, bias, heads))
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=2e-5)
    assert not got[~real].any()


@pytest.mark.parametrize("rows,width,heads,head_dim,longest",
                         [(16, 64, 12, 32, 20), (1, 128, 12, 64, 128), (3, 20, 2, 8, 6), (2, 33, 4, 24, 33),
                          (2, 40, 2, 16, 40), (1, 24, 1, 128, 24)])
def test_attention_within_segments_matches_the_masked_row(rows, width, heads, head_dim, longest):
    """Sequences of one token to the whole row (more queries than a vector's lanes), head sizes of 1-8 vectors and
    ones that leave vector tails, biases on q, k and v; padding comes out zero."""
    rng = np.random.default_rng(rows * width + head_dim)
    qkv = jnp.asarray(rng.standard_normal((rows, width, 3 * heads * head_dim)) * 2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(3 * heads * head_dim), jnp.float32)
    check(qkv, jnp.asarray(packed_segments(rng, rows, width, longest)), bias, heads)


def test_a_sequence_split_across_its_row_still_sees_all_its_tokens():
    """The kernel groups tokens by segment value, not by runs: interleaved sequences attend as the mask says."""
    rng = np.random.default_rng(3)
    qkv = jnp.asarray(rng.standard_normal((2, 12, 3 * 2 * 16)), jnp.float32)
    segments = jnp.asarray([[1, 2, 1, 2, 1, 0, 3, 3, 2, 1, 0, 0], [4, 4, 4, 1, 1, 4, 0, 0, 1, 1, 1, 1]], jnp.int32)
    check(qkv, segments, jnp.zeros(3 * 2 * 16, jnp.float32), 2)


def test_the_model_takes_the_kernel_for_float32_on_cpu_only():
    """The float32 encoder's attention is one custom call with no [R, H, W, W] scores; bfloat16 keeps XLA's."""
    from models.bert import SelfAttention
    from models.config import EncoderConfig

    cfg = EncoderConfig(architecture="BertModel", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, max_position_embeddings=16, type_vocab_size=1, layer_norm_eps=1e-12,
                        hidden_act="gelu", pad_token_id=0)
    x = jnp.ones((2, 8, 32), jnp.float32)
    segments = jnp.ones((2, 8), jnp.int32)
    f32, bf16 = (SelfAttention(cfg, dtype, nnx.Rngs(0)) for dtype in (jnp.float32, jnp.bfloat16))
    text = jax.jit(lambda a, s: f32(a, s)).lower(x, segments).as_text()
    assert "jvllm_segment_attention" in text and "8x8" not in text
    text = jax.jit(lambda a, s: bf16(a, s)).lower(x.astype(jnp.bfloat16), segments).as_text()
    assert "jvllm_segment_attention" not in text and "8x8" in text
