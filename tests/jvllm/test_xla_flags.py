"""jvllm's XLA CPU defaults: added to XLA_FLAGS, never overriding what the user set."""
from __future__ import annotations

import os

from jvllm.worker.xla_flags import CPU_DEFAULTS, apply_cpu_defaults


def test_defaults_join_existing_flags():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    flags = apply_cpu_defaults(environ).split()
    assert flags[0] == "--xla_force_host_platform_device_count=2"
    assert f"--xla_cpu_prefer_vector_width={CPU_DEFAULTS['xla_cpu_prefer_vector_width']}" in flags
    assert environ["XLA_FLAGS"] == " ".join(flags)


def test_a_flag_the_user_set_wins():
    environ = {"XLA_FLAGS": "--xla_cpu_prefer_vector_width=256"}
    assert apply_cpu_defaults(environ) == "--xla_cpu_prefer_vector_width=256"


def test_no_flags_before():
    environ: dict[str, str] = {}
    assert apply_cpu_defaults(environ) == "--xla_cpu_prefer_vector_width=512"
    assert apply_cpu_defaults(environ) == "--xla_cpu_prefer_vector_width=512"  # idempotent


def test_importing_jvllm_applied_them():
    assert "--xla_cpu_prefer_vector_width=" in os.environ.get("XLA_FLAGS", "")
