"""A step's host inputs sent to one device, reusing the device copy of every array that equals the one sent in its
place by the step before.

Most of a decode step's ~20 small input arrays (sampling settings, query starts and lengths, page tables between
page boundaries) repeat from step to step, and each `jax.device_put` of a numpy array costs ~45 us of Python on the
thread that dispatches the step (measured on the 2-core CPU); comparing a small array costs a few. The arrays that
did change go through jaxlib's batched transfer directly (~5 us each: the work `jax.device_put` wraps, without its
argument handling), or `jax.device_put` where that entry point is missing or refuses them."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

try:  # jaxlib's transfer behind jax.device_put; checked at first use, with jax.device_put as the fallback
    from jax._src import core as _core
    from jax._src.lib import xla_client as _xc
except ImportError:  # pragma: no cover - a jax without these modules
    _core = _xc = None


class InputTransfer:
    """Sends pytrees of numpy arrays to the default device; arrays equal to the last ones seen at the same place
    in a tree of the same structure are not sent again."""

    def __init__(self) -> None:
        self._last: dict[tuple[Any, int], tuple[np.ndarray, jax.Array]] = {}  # (tree, leaf) -> (host copy, device)
        self.sent = self.reused = 0  # arrays transferred / taken from an earlier step
        self._device = jax.devices()[0]
        self._sharding = jax.sharding.make_single_device_sharding(self._device)
        self._direct = _xc is not None and hasattr(_xc, "batched_device_put")

    def put(self, tree: Any) -> Any:
        """The tree with every numpy leaf as a device array (None leaves stay None)."""
        leaves, treedef = jax.tree.flatten(tree)
        out: list[Any] = [None] * len(leaves)
        fresh: list[int] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, jax.Array):  # already on the device (ids gathered from a previous step's)
                out[i] = leaf
                continue
            last = self._last.get((treedef, i))
            if last is not None and last[0].shape == np.shape(leaf) and last[0].dtype == np.result_type(leaf) \
                    and np.array_equal(last[0], leaf):
                out[i] = last[1]
                self.reused += 1
            else:
                fresh.append(i)
        self.sent += len(fresh)
        for i, array in zip(fresh, self._send([leaves[i] for i in fresh])):
            out[i] = array
            # a copy: callers may change their numpy arrays in place after the step (grammar masks do)
            self._last[(treedef, i)] = (np.array(leaves[i], copy=True), array)
        return jax.tree.unflatten(treedef, out)

    def _send(self, arrays: list[Any]) -> list[jax.Array]:
        if self._direct and all(isinstance(a, (np.ndarray, np.generic)) and a.dtype.itemsize <= 4 for a in arrays):
            try:
                return [_xc.batched_device_put(_core.ShapedArray(np.shape(a), a.dtype), self._sharding, [a],
                                               [self._device], True) for a in arrays]
            except (AttributeError, TypeError, ValueError):  # another jaxlib's signature: use the public path
                self._direct = False
        return jax.device_put(arrays, self._device)
