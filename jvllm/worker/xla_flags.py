"""XLA CPU code-generation defaults that jvllm sets before JAX starts its CPU backend."""
from __future__ import annotations

import os

# LLVM otherwise prefers 256-bit vectors even on AVX-512 machines (a 32 x 64-token prefill step ran 27% faster with
# 512). Machines without AVX-512 keep their widest vectors; GPU compiles ignore the flag.
CPU_DEFAULTS = {"xla_cpu_prefer_vector_width": "512"}


def apply_cpu_defaults(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """Append each default to XLA_FLAGS unless the user already set that flag; -> the resulting XLA_FLAGS.
    Takes effect only if no JAX backend has started yet (importing jvllm first does this)."""
    return append_unset_flags(CPU_DEFAULTS, environ)


def append_unset_flags(defaults: dict[str, str], environ: dict[str, str] | os._Environ = os.environ) -> str:
    """Append `--name=value` to XLA_FLAGS for each flag of `defaults` that XLA_FLAGS does not name yet."""
    flags = environ.get("XLA_FLAGS", "")
    extra = [f"--{name}={value}" for name, value in defaults.items() if f"--{name}" not in flags]
    if extra:
        environ["XLA_FLAGS"] = " ".join(part for part in (flags.strip(), *extra) if part)
    return environ.get("XLA_FLAGS", "")
