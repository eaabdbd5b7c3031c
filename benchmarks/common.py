"""What every benchmark records (the command that ran, the machine it ran on, the JSON file it writes), and the
order in which the peer comparisons run their engines."""
from __future__ import annotations

import json
import os
import platform
import sys
from typing import TypeVar

Item = TypeVar("Item")


def command_line(module: str, argv: list[str] | None) -> str:
    """`python -m benchmarks.NAME ARGS...` as the user typed it (argv None means sys.argv)."""
    return " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])


def cpu_model() -> str:
    """The CPU's model name as Linux reports it ('' where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def machine_info() -> dict:
    """Platform, CPU model, CPUs, Python / jax versions, backend, whether the native kernels' many-row products run
    on AMX (and from how many rows the few-row block sums do), and the load average at the time of the run."""
    import jax

    amx, amx_block_sums = False, 0
    if jax.default_backend() == "cpu":  # elsewhere the native kernels are neither built nor used
        try:
            from cpu_kernels.bf16_rows import amx_products
            from cpu_kernels.quantized_matmul import amx_block_sum_min_rows
            amx, amx_block_sums = amx_products(), amx_block_sum_min_rows()
        except Exception:  # no native kernels here (no compiler): nothing runs on AMX
            pass
    return {"platform": platform.platform(), "processor": platform.processor(), "cpu_model": cpu_model(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "device": str(jax.devices()[0]), "amx_products": amx,
            "amx_block_sum_min_rows": amx_block_sums, "load_average": os.getloadavg()}


def write_json(path: str | None, results: dict) -> None:
    """Write the results (indented) when a path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def round_order(engines: list[Item], round_index: int) -> list[Item]:
    """The engines in the order round `round_index` runs them: as given in even rounds, reversed in odd ones. An
    engine started right after another one can run slower (measured on the 2-core VMs), so which one goes first
    alternates."""
    return engines[::-1] if round_index % 2 else engines
