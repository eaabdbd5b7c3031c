"""Step inputs reach the device with their values, and equal arrays are not sent twice."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.worker.input_transfer import InputTransfer


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("direct", [True, False], ids=["jaxlib-transfer", "device_put"])
def test_values_arrive_and_repeated_arrays_are_reused(direct):
    transfer = InputTransfer()
    assert transfer._direct, "this jax's batched transfer entry point is missing: every step pays jax.device_put"
    transfer._direct = direct
    tree = {"ids": np.arange(4, dtype=np.int32), "scale": np.ones(2, np.float32), "flag": np.bool_(True), "none": None}
    first = transfer.put(tree)
    assert transfer.sent == 3 and transfer.reused == 0
    assert first["none"] is None and all(isinstance(x, jax.Array) for x in jax.tree.leaves(first))
    np.testing.assert_array_equal(first["ids"], tree["ids"])
    second = transfer.put({**tree, "ids": np.arange(1, 5, dtype=np.int32)})
    assert transfer.sent == 4 and transfer.reused == 2
    assert second["scale"] is first["scale"] and second["ids"] is not first["ids"]
    np.testing.assert_array_equal(second["ids"], [1, 2, 3, 4])
    assert transfer._direct == direct  # the direct path took these arrays without falling back
    assert second["flag"].dtype == jnp.bool_ and bool(second["flag"])


def test_an_array_changed_in_place_is_sent_again():
    transfer = InputTransfer()
    bits = np.zeros((2, 3), np.uint32)
    transfer.put((bits,))
    bits[1, 2] = 7  # a grammar narrows its row's mask in place
    (again,) = transfer.put((bits,))
    np.testing.assert_array_equal(again, bits)


def test_shape_or_dtype_change_is_sent_again_and_device_arrays_pass_through():
    transfer = InputTransfer()
    transfer.put((np.zeros(3, np.int32),))
    (wider,) = transfer.put((np.zeros(4, np.int32),))
    (as_float,) = transfer.put((np.zeros(4, np.float32),))
    assert wider.shape == (4,) and as_float.dtype == jnp.float32
    on_device = jnp.arange(3)
    (same,) = transfer.put((on_device,))
    assert same is on_device
    assert _host(transfer.put((np.zeros(4, np.float32),)))[0].dtype == np.float32
