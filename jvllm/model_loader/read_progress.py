"""A byte progress bar while weights are read (off with JVLLM_NO_PROGRESS=1; not shown for small models)."""
from __future__ import annotations

import os
from typing import Any

MIN_BYTES = 64 << 20  # smaller reads take well under a second: no bar


def weight_bar(total_bytes: int, desc: str = "Reading weights") -> Any:
    """A tqdm bar over `total_bytes` (advance it with .update(nbytes)); a disabled one for small reads."""
    from tqdm.auto import tqdm

    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                disable=total_bytes < MIN_BYTES or os.environ.get("JVLLM_NO_PROGRESS") == "1")
