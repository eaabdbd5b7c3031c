"""The `jvllm` command's entry point. The process is jvllm's own, so Python's garbage collector stays off the
imports and the heap an engine builds at start-up (both live until exit; jvllm.collector), then the command line
(`entrypoints.cli.main`) runs."""
from __future__ import annotations

import gc


def run() -> int:
    gc.disable()  # importing jax, transformers, the server: ~400k objects, walked again by every full collection
    from jvllm.collector import own_process
    from entrypoints.cli import main

    gc.freeze()  # what the imports built stays; O(1), nothing is walked
    gc.enable()
    own_process()
    return main()
