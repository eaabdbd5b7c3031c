"""Image downloads over http(s): checked addresses only, redirects followed by hand, bounded in bytes and total time."""
from __future__ import annotations

import functools
import socket
import threading
import time
import urllib.parse
from typing import Any

from jvllm.multimodal.url_policy import IPAddress, Target, UrlPolicy

MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


class Deadline:
    """A fetch's total time limit. Connections opened under it are shut down when it passes, which ends a read
    still waiting on a server that sends slowly or not at all."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.ends = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        """Seconds left; TimeoutError once none are."""
        left = self.ends - time.monotonic()
        if left <= 0 or self.expired:
            raise TimeoutError
        return left

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpx's `trace` request extension: keeps a duplicate of each new connection's socket to shut down."""
        if event != "connection.connect_tcp.complete":
            return
        sock = info["return_value"].get_extra_info("socket")
        if sock is None:
            return
        with self._lock:
            self._sockets.append(sock.dup())  # the original is detached when TLS wraps it; the duplicate is not
            if self.expired:
                _shutdown(self._sockets[-1])

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shutdown(sock)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


@functools.lru_cache(maxsize=1)
def _ssl_context() -> Any:
    import httpx

    return httpx.create_ssl_context()  # certifi's roots, or $SSL_CERT_FILE / $SSL_CERT_DIR


def fetch(url: str, policy: UrlPolicy, timeout_s: float, max_bytes: int) -> bytes:
    """The body of an http(s) URL the policy allows, following at most MAX_REDIRECTS redirects, each checked again.
    ValueError naming the reason for every failure."""
    import httpx

    deadline = Deadline(timeout_s)
    try:
        # trust_env=False: no proxy from the environment, so the request goes to the address that was checked
        with httpx.Client(trust_env=False, verify=_ssl_context(), follow_redirects=False) as client:
            return _follow(client, url, policy, deadline, max_bytes)
    except (TimeoutError, httpx.TimeoutException):
        raise ValueError(f"fetching the image timed out after {timeout_s} s: {url}") from None
    except httpx.HTTPError as error:
        if deadline.expired:
            raise ValueError(f"fetching the image timed out after {timeout_s} s: {url}") from None
        raise ValueError(f"fetching the image failed: {error}") from None
    finally:
        deadline.close()


def _follow(client: Any, url: str, policy: UrlPolicy, deadline: Deadline, max_bytes: int) -> bytes:
    current = url
    for hop in range(MAX_REDIRECTS + 1):
        try:
            target = policy.check(current, deadline.remaining())
        except ValueError as error:
            raise (ValueError(f"the image URL {url} redirected to {current}, which is refused: {error}") if hop
                   else error) from None
        body, location = _get_any_address(client, target, deadline, max_bytes)
        if location is None:
            return body
        current = urllib.parse.urljoin(current, location)
    raise ValueError(f"the image URL {url} redirected more than {MAX_REDIRECTS} times")


def _get_any_address(client: Any, target: Target, deadline: Deadline,
                     max_bytes: int) -> tuple[bytes, str | None]:
    """GET from the target's checked addresses in turn until one connects."""
    import httpx

    for address in target.addresses[:-1]:
        try:
            return _get(client, target, address, deadline, max_bytes)
        except httpx.ConnectError:
            continue
    return _get(client, target, target.addresses[-1], deadline, max_bytes)


def _get(client: Any, target: Target, address: IPAddress, deadline: Deadline,
         max_bytes: int) -> tuple[bytes, str | None]:
    """-> (the body, None) for a 200, or (b"", the Location) for a redirect."""
    request = client.build_request(
        "GET", target.pinned_url(address), headers={**target.headers(), "Accept-Encoding": "identity"},
        timeout=deadline.remaining(), extensions={**target.extensions(), "trace": deadline.trace})
    response = client.send(request, stream=True)
    try:
        if response.status_code in REDIRECT_STATUSES:
            location = response.headers.get("location")
            if not location:
                raise ValueError(f"the image URL {target.url} redirected (HTTP {response.status_code}) without a "
                                 "Location")
            return b"", location
        if response.status_code != 200:
            raise ValueError(f"fetching the image failed: HTTP {response.status_code} from {target.url}")
        return _read_body(response, target.url, deadline, max_bytes), None
    finally:
        response.close()


def _read_body(response: Any, url: str, deadline: Deadline, max_bytes: int) -> bytes:
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ValueError(f"the server sent the image with Content-Encoding {encoding!r}; only uncompressed "
                         "transfers are accepted")
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ValueError(f"the image at {url} is larger than {max_bytes} bytes")
    body = bytearray()
    for piece in response.iter_raw():
        body += piece
        if len(body) > max_bytes:
            raise ValueError(f"the image at {url} is larger than {max_bytes} bytes")
        deadline.remaining()  # a server sending slowly is cut off here or by the deadline's socket shutdown
    return bytes(body)
