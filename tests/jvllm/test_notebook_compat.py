"""generate() must work where an event loop is already running, as inside a Jupyter kernel."""
from __future__ import annotations

import asyncio

from jvllm import SamplingParams


def test_generate_inside_a_running_event_loop(default_engine):
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = default_engine.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text

    async def notebook_cell() -> str:
        assert asyncio.get_running_loop().is_running()
        return default_engine.generate("Once upon a time", params)[0].outputs[0].text

    assert asyncio.run(notebook_cell()) == expected
