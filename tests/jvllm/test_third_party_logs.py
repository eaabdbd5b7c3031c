"""Start-up notices of transformers and jax that read like a broken install stay out of jvllm's default logs."""
from __future__ import annotations

import logging
import subprocess
import sys

import jvllm  # noqa: F401  (quiets the notices on import)


def test_transformers_torch_notice_is_dropped_and_its_other_warnings_kept(caplog):
    logger = logging.getLogger("transformers")
    with caplog.at_level(logging.WARNING, logger="transformers"):
        logger.warning("PyTorch was not found. Models won't be available and only tokenizers, ... can be used.")
        logger.warning("a tokenizer warning")
    assert [r.getMessage() for r in caplog.records] == ["a tokenizer warning"]


def test_a_cli_at_info_level_shows_no_backend_probe_failures():
    """`jvllm serve --log-level info` configures the root logger at INFO; jax's failed TPU probe stays quiet."""
    code = ("import logging; logging.basicConfig(level=logging.INFO); import jvllm, jax; jax.devices(); "
            "logging.getLogger('jax._src.xla_bridge').info('probe-at-info') ; "
            "logging.getLogger('jax._src.xla_bridge').warning('probe-at-warning')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "probe-at-info" not in done.stderr and "Unable to initialize backend" not in done.stderr, done.stderr
    assert "probe-at-warning" in done.stderr
