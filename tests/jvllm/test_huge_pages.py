"""Host buffers backed by 2 MiB pages (jvllm.worker.huge_pages): which aligned ranges a set of buffers covers, where
the CPU buffers of arrays lie, and that advising them leaves their contents as they were."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jvllm.worker.huge_pages import HUGE_PAGE, back_with_huge_pages, host_buffers, huge_page_ranges


def test_ranges_cover_every_buffer_once_in_order():
    base = 7 * HUGE_PAGE
    buffers = [(base + 100, 4096), (base + 200_000, 300_000),  # side by side in one range
               (base + HUGE_PAGE - 10, 20),  # straddles two ranges
               (base + 5 * HUGE_PAGE + 1, 2 * HUGE_PAGE),  # spans three
               (base + 3 * HUGE_PAGE, 0)]  # empty: none
    assert huge_page_ranges(buffers) == [base + i * HUGE_PAGE for i in (0, 1, 5, 6, 7)]
    assert huge_page_ranges([]) == []


def test_host_buffers_are_the_arrays_own():
    arrays = [jnp.arange(1000, dtype=jnp.float32), jnp.ones((64, 64), jnp.int8)]
    buffers = host_buffers(arrays)
    assert [size for _, size in buffers] == [4000, 4096]
    assert [address for address, _ in buffers] == [a.unsafe_buffer_pointer() for a in arrays]


def test_advising_keeps_the_contents():
    array = jnp.asarray(np.random.default_rng(0).standard_normal((3 << 20) // 4), jnp.float32)  # 3 MiB
    before = np.asarray(array).copy()
    collapsed = back_with_huge_pages([array])
    assert collapsed % HUGE_PAGE == 0 and collapsed <= 3 * HUGE_PAGE  # 0 where the OS refuses
    np.testing.assert_array_equal(np.asarray(array), before)
