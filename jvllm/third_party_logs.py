"""Start-up notices of libraries jvllm uses that read like a broken install, kept out of the default logs."""
from __future__ import annotations

import logging

# transformers, imported without torch (jvllm never needs it): tokenizers and configs are all jvllm reads.
_TORCH_ABSENT = "PyTorch was not found"
# jax probes every backend at start; on a machine without libtpu the TPU probe's failure is logged at INFO.
_JAX_BACKEND_PROBE = "jax._src.xla_bridge"


def _not_torch_absent(record: logging.LogRecord) -> bool:
    return _TORCH_ABSENT not in str(record.msg)


def quiet_third_party_notices() -> None:
    """Drop transformers' "PyTorch was not found" warning and show jax's backend probes from WARNING up. Both
    loggers are set before the libraries are imported, which configure them without removing either."""
    logging.getLogger("transformers").addFilter(_not_torch_absent)
    probe = logging.getLogger(_JAX_BACKEND_PROBE)
    if probe.level == logging.NOTSET:  # a level the user set stays
        probe.setLevel(logging.WARNING)
