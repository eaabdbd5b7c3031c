"""What `jvllm bench` prints and saves: percentiles, a summary table, JSON results."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def distribution(values_s: list[float], name: str) -> dict[str, float]:
    """Mean and percentiles of durations in seconds, as milliseconds keyed like vLLM's results (mean_ttft_ms,
    p99_ttft_ms, ...); zeros when there are none."""
    values = np.asarray(values_s, np.float64) * 1000 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values))}
    out.update({f"p{p}_{name}_ms": float(np.percentile(values, p)) for p in PERCENTILES})
    return out


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max(len(label) for label, _ in rows) + 2
    print(f"{'=' * 20} {title} {'=' * 20}")
    for label, value in rows:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label + ':':<{width}}{text:>14}")
    print("=" * (42 + len(title)))


def save(results: dict, path: str | None) -> None:
    """Write the results as JSON (the folder is created)."""
    if not path:
        return
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"results saved to {path}")
