"""tqdm progress bars: generate()'s finished requests (output tokens/s in the postfix), and precompiling."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

from jvllm.outputs import RequestOutput


class GenerateProgress:
    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self._started = time.perf_counter()
        self._output_tokens = 0  # of the finished requests

    def update(self, output: RequestOutput) -> None:
        """Count a finished request (vLLM's bar too moves on finished requests only); other outputs are ignored."""
        if self._bar is None or not output.finished:
            return
        self._output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(f"output {self._output_tokens / elapsed:.1f} tok/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def precompile_progress(total: int) -> Iterator[Any]:
    """A bar over the step shapes compiled at start (off with JVLLM_NO_PROGRESS=1, e.g. in logs-only setups)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="Compiling step shapes", unit="shape", dynamic_ncols=True,
               disable=os.environ.get("JVLLM_NO_PROGRESS") == "1")
    try:
        yield bar
    finally:
        bar.close()
