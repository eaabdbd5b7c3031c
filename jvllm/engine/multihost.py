"""The multi-host roles of an Engine: rank 0 schedules and generates, the other ranks follow its steps."""
from __future__ import annotations

import logging
from typing import Any

from jvllm.parallel import distributed
from jvllm.worker.compile_watch import compile_watch

logger = logging.getLogger("jvllm")


class MultiHostRoles:
    """Mixed into Engine, which sets `channel` (a StepChannel, or None on one host) and `runner`."""

    channel: Any
    runner: Any

    @property
    def is_leader(self) -> bool:
        """True on a single host and on rank 0 of several: the process that schedules and generates."""
        return self.channel is None or self.channel.is_leader

    def follow(self) -> int:
        """On a follower host (rank > 0): run rank 0's steps until it shuts down; -> steps run."""
        if self.is_leader:
            raise RuntimeError("follow() is for hosts of rank > 0; rank 0 generates and calls shutdown()")
        # Rank 0's watch judges each step's compiles; a follower compiles what rank 0's steps ask for, the
        # diagnostics rank 0 expects included, so its own warnings would only repeat (or contradict) rank 0's.
        with compile_watch().expected():
            steps = distributed.follow(self.channel, self.runner.run_call)
        logger.info("rank 0 shut down after %d steps", steps)
        return steps

    def shutdown(self) -> None:
        """On rank 0 of several hosts: release the followers (idempotent; also registered at exit)."""
        if self.channel is not None and self.channel.is_leader:
            self.channel.shutdown()

    @property
    def heartbeat_interval_s(self) -> float | None:
        """How long an idle rank 0 may leave its followers waiting (None: a single host, no followers)."""
        return None if self.channel is None else distributed.HEARTBEAT_INTERVAL_S

    def heartbeat(self) -> None:
        """Rank 0, idle: a no-op message that keeps the followers' pending collective short-lived."""
        if self.channel is not None and self.channel.is_leader and not self.channel.closed:
            self.channel.heartbeat()

    def _check_leader(self) -> None:
        if not self.is_leader:
            raise RuntimeError("this host follows rank 0: call follow() here and generate on rank 0")
