"""KV writes and the `pallas` backend's write_and_attend agree with the references and the `xla` backend."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_inputs import TOLERANCE, engine_metadata, random_array

from jvllm.attention import get_backend
from jvllm.attention import xla
from jvllm.worker.step_shapes import ShapeSet
from pallas_kernels.kv_write import write_kv
from pallas_kernels.reference import write_kv_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("method", ["scatter", "kernel"])
def test_write_kv_puts_each_token_in_its_slot(dtype, method):
    rng = np.random.default_rng(0)
    pages = random_array(rng, (6, 16, 2, 64), dtype)
    slots = rng.permutation(np.arange(16, 6 * 16))[:11].astype(np.int32)  # real tokens, scattered over pages
    slots = jnp.asarray(np.concatenate([slots, np.zeros(5, np.int32)]))  # padding tokens dump into slot 0
    k, v = random_array(rng, (16, 2, 64), dtype), random_array(rng, (16, 2, 64), dtype)
    write = jax.jit(functools.partial(write_kv, method=method))
    k_out, v_out = write(pages, pages, k, v, slots)
    for out, new in ((k_out, k), (v_out, v)):
        expected = write_kv_reference(pages, new, slots)
        # page 0 is the padding dump: which padding token lands last is unspecified
        np.testing.assert_array_equal(np.asarray(out[1:], np.float32), np.asarray(expected[1:], np.float32))
        np.testing.assert_array_equal(np.asarray(out[0, 1:], np.float32), np.asarray(pages[0, 1:], np.float32))


SHAPES, MAX_PAGES = ShapeSet(max_num_seqs=8, max_num_batched_tokens=64), 8
STEPS = {  # (cached tokens, new tokens) per scheduled chunk, as the scheduler would hand them over
    "prefill": [(0, 21), (0, 6)],  # prefill T=32 S=8
    "mixed": [(0, 13), (35, 1), (17, 9), (3, 1)],  # prefill T=32 S=8: decode tokens beside chunks
    "decode": [(40, 1), (15, 1), (0, 1)],  # decode T=S=4, one padding row
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (8, None), (None, 1.5)],
                         ids=["full", "window", "soft-cap"])
def test_write_and_attend_matches_xla_backend(dtype, step, sliding_window, soft_cap):
    """The same step (same chunks, same pages) as each backend's engine builds it, its own layout included."""
    page_size, kv_heads, group, head_dim, num_pages = 16, 2, 3, 64, 14
    backend, xla_backend = (get_backend(name).for_model(kv_heads * group, kv_heads, head_dim, dtype)
                            for name in ("pallas", "xla"))
    md, real = engine_metadata(STEPS[step], page_size, num_pages, np.random.default_rng(1), SHAPES, MAX_PAGES,
                               backend)
    xla_md, _ = engine_metadata(STEPS[step], page_size, num_pages, np.random.default_rng(1), SHAPES, MAX_PAGES,
                                xla_backend)
    np.testing.assert_array_equal(md.page_tables, xla_md.page_tables)
    assert md.decode == (step == "decode") and (md.decode or "item_seq" in md.layout)
    rng = np.random.default_rng(2)
    num_tokens = md.slot_mapping.shape[0]
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages, v_pages = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    q = random_array(rng, (num_tokens, kv_heads * group, head_dim), dtype)
    k, v = (random_array(rng, (num_tokens, kv_heads, head_dim), dtype) for _ in range(2))
    scale = head_dim ** -0.5

    assert backend.name == "pallas" and backend.step_donates_pool
    out, k_new, v_new = jax.jit(backend.write_and_attend, static_argnums=(6, 7, 8))(
        q, k, v, k_pages, v_pages, md, scale, sliding_window, soft_cap)
    with jax.default_matmul_precision("highest"):  # on a GPU XLA's float32 dots default to TF32; the kernel's are not
        expected = xla.paged_attention(q, k, v, k_pages, v_pages, xla_md, scale, sliding_window, soft_cap)
    [(k_ref, v_ref)] = xla.write_layers([(k_pages, v_pages)], [(k, v)], xla_md)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.abs(np.asarray(expected[:real], np.float32)).sum(axis=(1, 2)).min() > 0  # every token attended
    np.testing.assert_allclose(np.asarray(out[:real], np.float32), np.asarray(expected[:real], np.float32),
                               **TOLERANCE[dtype])
    np.testing.assert_array_equal(np.asarray(k_new[1:], np.float32), np.asarray(k_ref[1:], np.float32))
    np.testing.assert_array_equal(np.asarray(v_new[1:], np.float32), np.asarray(v_ref[1:], np.float32))


def test_interpret_follows_backend_and_env(monkeypatch):
    from pallas_kernels.common import default_interpret

    monkeypatch.delenv("JVLLM_PALLAS_INTERPRET", raising=False)
    assert default_interpret() == (jax.default_backend() != "gpu")
    monkeypatch.setenv("JVLLM_PALLAS_INTERPRET", "1")
    assert default_interpret()
    monkeypatch.setenv("JVLLM_PALLAS_INTERPRET", "0")
    assert not default_interpret()
