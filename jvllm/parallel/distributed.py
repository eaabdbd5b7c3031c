"""Multi-host serving: jax.distributed start-up, and rank 0's step inputs sent to the other ranks through
JAX's own collectives (multihost_utils.broadcast_one_to_all), so every host runs the same jitted step."""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from typing import Any

import numpy as np

from jvllm.utils import next_power_of_2

logger = logging.getLogger("jvllm")

ENV_NUM_HOSTS, ENV_HOST_RANK, ENV_COORDINATOR = "JVLLM_NUM_HOSTS", "JVLLM_HOST_RANK", "JVLLM_COORDINATOR"
_FIRST = 16384  # bytes of the first broadcast: header + a typical step's whole payload
_HEADER = 16  # int64 kind, int64 payload length
# The rest of a longer payload goes in buffers of a power of two bytes in [_REST_MIN, _REST_MAX] (the last padded),
# so the broadcasts come in a closed set of sizes that `warm_up` compiles at start.
_REST_MIN, _REST_MAX = 1 << 12, 1 << 22
_STEP, _SHUTDOWN, _HEARTBEAT = 1, 2, 3
HEARTBEAT_INTERVAL_S = 60.0  # an idle rank 0 (the server's engine thread) pings its followers this often


@dataclasses.dataclass(frozen=True)
class HostSettings:
    """This process's place in a multi-host deployment (num_hosts 1: a single process, nothing to start)."""

    num_hosts: int = 1
    host_rank: int = 0
    coordinator: str | None = None

    @classmethod
    def resolve(cls, num_hosts: int | None = None, host_rank: int | None = None,
                coordinator: str | None = None) -> "HostSettings":
        """Arguments first, then JVLLM_NUM_HOSTS / JVLLM_HOST_RANK / JVLLM_COORDINATOR; validated."""
        env = os.environ
        num_hosts = num_hosts if num_hosts is not None else int(env.get(ENV_NUM_HOSTS, "1"))
        host_rank = host_rank if host_rank is not None else int(env.get(ENV_HOST_RANK, "0"))
        coordinator = coordinator or env.get(ENV_COORDINATOR) or None
        if num_hosts < 1:
            raise ValueError(f"num_hosts must be a positive integer, got {num_hosts}")
        if not 0 <= host_rank < num_hosts:
            raise ValueError(f"host_rank={host_rank} must be in [0, num_hosts={num_hosts})")
        if num_hosts > 1 and not coordinator:
            raise ValueError("num_hosts > 1 needs coordinator=HOST:PORT (--coordinator or $JVLLM_COORDINATOR): "
                             "an address of rank 0 that every host can reach")
        return cls(num_hosts, host_rank, coordinator)

    @property
    def multi_host(self) -> bool:
        return self.num_hosts > 1


def initialize(settings: HostSettings) -> None:
    """Start jax.distributed (before anything else touches a JAX backend) unless it is already up; a no-op for one
    host. CPU hosts exchange collectives over gloo."""
    import jax

    if not settings.multi_host:
        return
    if not jax.distributed.is_initialized():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=settings.coordinator, num_processes=settings.num_hosts,
                                   process_id=settings.host_rank)
    same_programs_on_every_host()
    logger.info("jax.distributed up: host %d of %d, %d local / %d global devices", jax.process_index(),
                jax.process_count(), jax.local_device_count(), jax.device_count())


def same_programs_on_every_host() -> None:
    """Keep Python tracebacks out of the locations of the programs JAX builds, so that every host builds the same
    bytes. The hosts trace the same steps from different calls (rank 0 under `generate`, the others under
    `follow`), and from jax 0.12.1 hosts whose copies of a program differ only in those locations wait forever in
    its first collective (docs/design/gpu_and_parallel.md). JAX's own errors keep their tracebacks; XLA's messages
    lose the Python source lines."""
    import jax

    jax.config.update("jax_traceback_in_locations_limit", 0)


def broadcast_from_leader(value: np.ndarray) -> np.ndarray:
    """Rank 0's `value` on every host (same shape and dtype everywhere; the others' contents are ignored)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(value))


def rest_buffer_sizes(rest: int) -> list[int]:
    """Bytes of each buffer that carries `rest` payload bytes after the first broadcast: _REST_MAX-byte chunks,
    then the remainder padded to a power of two of at least _REST_MIN."""
    full, remainder = divmod(rest, _REST_MAX)
    return [_REST_MAX] * full + ([max(_REST_MIN, next_power_of_2(remainder))] if remainder else [])


def message_buffer_sizes() -> list[int]:
    """Every buffer size a message's broadcasts use: _FIRST, and the powers of two from _REST_MIN to _REST_MAX."""
    return sorted({_FIRST, *(1 << bits for bits in range(_REST_MIN.bit_length() - 1, _REST_MAX.bit_length()))})


class StepChannel:
    """Rank 0 `send`s each step's host inputs (any picklable object; None = shut down), the other ranks
    `receive` them in the same order. A message is one broadcast of a fixed _FIRST-byte uint8 buffer (header
    [kind, length], then the pickled payload), plus buffers of `rest_buffer_sizes` for any payload that does not
    fit. The hosts are one deployment: followers trust rank 0's pickles."""

    def __init__(self) -> None:
        import jax

        self.is_leader = jax.process_index() == 0
        self.closed = False

    def warm_up(self) -> None:
        """Every host, at the same point of start-up: broadcast one buffer of each size a message can use, so
        that none compiles while steps run."""
        for size in message_buffer_sizes():
            broadcast_from_leader(np.zeros(size, np.uint8))

    def _send(self, kind: int, payload: bytes = b"") -> None:
        assert self.is_leader, "only rank 0 sends steps"
        if self.closed:
            raise RuntimeError("the step channel was shut down")
        first = np.zeros(_FIRST, np.uint8)
        first[:_HEADER] = np.array([kind, len(payload)], np.int64).view(np.uint8)
        head = payload[:_FIRST - _HEADER]
        first[_HEADER:_HEADER + len(head)] = np.frombuffer(head, np.uint8)
        broadcast_from_leader(first)
        start = len(head)
        for size in rest_buffer_sizes(len(payload) - start):
            piece = payload[start:start + size]
            buffer = np.zeros(size, np.uint8)
            buffer[:len(piece)] = np.frombuffer(piece, np.uint8)
            broadcast_from_leader(buffer)
            start += size

    def send(self, message: Any) -> None:
        if message is None:
            self._send(_SHUTDOWN)
            self.closed = True
        else:
            self._send(_STEP, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def heartbeat(self) -> None:
        """Rank 0: a message the followers skip (see HEARTBEAT_INTERVAL_S)."""
        self._send(_HEARTBEAT)

    def receive(self) -> Any:
        """The next message from rank 0 (blocks until rank 0 sends one); None once it shuts down."""
        kind = _HEARTBEAT
        while kind == _HEARTBEAT:
            first = broadcast_from_leader(np.zeros(_FIRST, np.uint8))
            kind, length = first[:_HEADER].view(np.int64).tolist()
        if kind == _SHUTDOWN:
            self.closed = True
            return None
        pieces = [first[_HEADER:_HEADER + length].tobytes()]
        rest = length - len(pieces[0])
        for size in rest_buffer_sizes(rest):
            pieces.append(broadcast_from_leader(np.zeros(size, np.uint8))[:min(size, rest)].tobytes())
            rest -= size
        payload = b"".join(pieces)
        return pickle.loads(payload)

    def shutdown(self) -> None:
        """Rank 0: tell the followers to stop (idempotent)."""
        if self.is_leader and not self.closed:
            self.send(None)


def follow(channel: StepChannel, run: Any) -> int:
    """On a follower host: `run` every step rank 0 sends until it sends shutdown; -> steps run."""
    steps = 0
    while (call := channel.receive()) is not None:
        run(call)
        steps += 1
    return steps


def agree_on_int(value: int) -> int:
    """Rank 0's value of a host-computed setting (e.g. the page count), so every host builds the same pool."""
    return int(broadcast_from_leader(np.array([value], np.int64))[0])
