"""LLM() in a plain program logs its start-up phases at INFO (as vLLM does), unless logging was set up or turned off."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROGRAM = """
import logging, sys
{setup}
from jvllm.logging_setup import configure_default_logging
configure_default_logging()
logging.getLogger("jvllm.model_loader").info("a phase line")
logging.getLogger("jvllm").debug("a debug line")
"""


@pytest.mark.parametrize("setup, env, shown", [
    ("", {}, True),  # a plain program: the phase line shows, the debug line does not
    ("logging.basicConfig(level=logging.WARNING)", {}, False),  # the program's own configuration wins
    ("", {"JVLLM_CONFIGURE_LOGGING": "0"}, False),
    ("", {"JVLLM_LOGGING_LEVEL": "warning"}, False),
])
def test_phase_lines_show_only_where_nobody_configured_logging(setup, env, shown):
    run = subprocess.run([sys.executable, "-c", PROGRAM.format(setup=setup)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert ("jvllm.model_loader: a phase line" in run.stderr) is shown
    assert "a debug line" not in run.stderr
