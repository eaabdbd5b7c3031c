"""The server's open-file limit, raised at start: every client connection holds a file descriptor, and a soft limit
of 1,024 (common on Linux) would refuse connections ("Too many open files") long before the engine is busy."""
from __future__ import annotations

import logging

logger = logging.getLogger("jvllm.server")

# The soft limit asked for (vLLM's server asks the same), within the hard limit the system allows.
TARGET_OPEN_FILES = 65535
# Below this many descriptors, say how to raise the limit: fewer concurrent connections than a load test opens.
WARN_BELOW_OPEN_FILES = 4096


def raise_open_files_limit(target: int = TARGET_OPEN_FILES) -> int | None:
    """Raise the soft RLIMIT_NOFILE to `target`, or to the hard limit if lower; -> the soft limit now (None where
    the platform has no such limit)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as error:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, wanted, error)
    if soft != resource.RLIM_INFINITY and soft < WARN_BELOW_OPEN_FILES:
        logger.warning("the open-file limit is %d: about as many concurrent connections at most (each holds one); "
                       "raise the hard limit (ulimit -Hn, or LimitNOFILE= in a systemd unit) for more", soft)
    return soft
