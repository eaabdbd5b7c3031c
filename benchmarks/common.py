"""What every benchmark records: the command that ran, the machine it ran on, and the JSON file it writes."""
from __future__ import annotations

import json
import os
import platform
import sys


def command_line(module: str, argv: list[str] | None) -> str:
    """`python -m benchmarks.NAME ARGS...` as the user typed it (argv None means sys.argv)."""
    return " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])


def machine_info() -> dict:
    """Platform, CPUs, Python / jax versions, backend and the load average at the time of the run."""
    import jax

    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0]), "load_average": os.getloadavg()}


def write_json(path: str | None, results: dict) -> None:
    """Write the results (indented) when a path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
