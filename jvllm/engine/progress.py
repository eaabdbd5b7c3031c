"""tqdm progress for generate(): finished requests, with output tokens/s in the postfix."""
from __future__ import annotations

import time

from jvllm.outputs import RequestOutput


class GenerateProgress:
    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self._started = time.perf_counter()
        self._tokens: dict[str, int] = {}

    def update(self, output: RequestOutput) -> None:
        if self._bar is None:
            return
        self._tokens[output.request_id] = sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(f"output {sum(self._tokens.values()) / elapsed:.1f} tok/s", refresh=False)
        if output.finished:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
