"""The `mosaic` attention backend (the Mosaic GPU kernels, either ragged kernel) gives the `xla` backend's outputs for
the same steps, in Mosaic GPU's interpret mode on CPU (jax >= 0.11) or compiled on a GPU; float32 models stay on the
Triton kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_inputs import TOLERANCE, engine_metadata, random_array

from jvllm.attention import get_backend
from jvllm.attention import xla
from jvllm.attention.pallas import MOSAIC_RAGGED_ENV
from jvllm.worker.step_shapes import ShapeSet

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU's interpret mode and plgpu.kernel "
                                "need jax >= 0.11: ci/gpu_versions_leg.sh runs these")

SHAPES, MAX_PAGES = ShapeSet(max_num_seqs=8, max_num_batched_tokens=64), 8
STEPS = {"decode": [(40, 1), (15, 1), (0, 1)], "mixed": [(0, 13), (35, 1), (17, 9)], "prefill": [(0, 21), (0, 6)]}


@pytest.mark.parametrize("dtype, ragged_kernel", [(jnp.bfloat16, "one_warpgroup"), (jnp.float32, "one_warpgroup"),
                                                   (jnp.bfloat16, "warp_specialized")],
                         ids=["bf16", "f32", "bf16-warp_specialized"])
@pytest.mark.parametrize("step", list(STEPS))
def test_mosaic_backend_matches_xla_backend(step, dtype, ragged_kernel, monkeypatch):
    monkeypatch.setenv(MOSAIC_RAGGED_ENV, ragged_kernel)
    page_size, kv_heads, group, head_dim, num_pages = 16, 2, 4, 64, 14
    backend, xla_backend = (get_backend(name).for_model(kv_heads * group, kv_heads, head_dim, dtype)
                            for name in ("mosaic", "xla"))
    md, real = engine_metadata(STEPS[step], page_size, num_pages, np.random.default_rng(1), SHAPES, MAX_PAGES,
                               backend)
    xla_md, _ = engine_metadata(STEPS[step], page_size, num_pages, np.random.default_rng(1), SHAPES, MAX_PAGES,
                                xla_backend)
    rng = np.random.default_rng(2)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages, v_pages = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    num_tokens = md.slot_mapping.shape[0]
    q = random_array(rng, (num_tokens, kv_heads * group, head_dim), dtype)
    k, v = (random_array(rng, (num_tokens, kv_heads, head_dim), dtype) for _ in range(2))
    scale = head_dim ** -0.5
    assert backend.name == "mosaic" and md.decode == (step == "decode")
    if not md.decode:  # work items of the Mosaic GPU kernel's queries (64, or 128 warp-specialized) for bf16, the
        # Triton kernel's for f32
        block_q = 128 if ragged_kernel == "warp_specialized" else 64
        mosaic_items = -(-num_tokens // block_q) + md.q_lens.shape[0]
        assert (md.layout["item_seq"].shape[0] == mosaic_items) == (dtype == jnp.bfloat16)
    out, k_new, _ = jax.jit(backend.write_and_attend, static_argnums=(6, 7, 8))(
        q, k, v, k_pages, v_pages, md, scale, None, None)
    with jax.default_matmul_precision("highest"):  # on a GPU XLA's float32 dots default to TF32
        expected = xla.paged_attention(q, k, v, k_pages, v_pages, xla_md, scale, None, None)
    [(k_ref, _)] = xla.write_layers([(k_pages, v_pages)], [(k, v)], xla_md)
    np.testing.assert_allclose(np.asarray(out[:real], np.float32), np.asarray(expected[:real], np.float32),
                               **TOLERANCE[dtype])
    np.testing.assert_array_equal(np.asarray(k_new[1:], np.float32), np.asarray(k_ref[1:], np.float32))


def test_ragged_kernel_choice(monkeypatch):
    """By default the warp-specialized kernel where it covers the head dim (<= 128), the one-warpgroup one beyond;
    JVLLM_MOSAIC_RAGGED picks the one-warpgroup kernel, and a misspelt choice is an error that names both."""
    from jvllm.attention.pallas import mosaic_ragged_kernel
    from pallas_kernels import mosaic_ragged, mosaic_ragged_ws

    monkeypatch.delenv(MOSAIC_RAGGED_ENV, raising=False)
    assert mosaic_ragged_kernel(128) == (mosaic_ragged_ws.BLOCK_Q, mosaic_ragged_ws.mosaic_ragged_ws_attention)
    assert mosaic_ragged_kernel(256) == (mosaic_ragged.BLOCK_Q, mosaic_ragged.mosaic_ragged_paged_attention)
    monkeypatch.setenv(MOSAIC_RAGGED_ENV, "one_warpgroup")
    assert mosaic_ragged_kernel(128) == (mosaic_ragged.BLOCK_Q, mosaic_ragged.mosaic_ragged_paged_attention)
    monkeypatch.setenv(MOSAIC_RAGGED_ENV, "warp-specialised")
    with pytest.raises(ValueError, match="one_warpgroup or warp_specialized"):
        mosaic_ragged_kernel(128)
