"""Which http(s) image URLs the server may fetch: public addresses only, or the operator's allow-list of hosts."""
from __future__ import annotations

import dataclasses
import ipaddress
import socket
import threading
import urllib.parse
from typing import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Names that reach the server itself or a cloud metadata service whatever DNS says.
BLOCKED_HOSTNAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback",
                               "metadata", "metadata.google.internal", "instance-data", "instance-data.ec2.internal"})
CARRIER_GRADE_NAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known prefix: the last 32 bits are an IPv4 address
DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_host(host: str) -> str:
    """A hostname or IP literal in the form both the allow-list and URLs are compared in: lower case, no trailing
    dot, no IPv6 brackets, IP literals in their canonical form, international names in IDNA (ASCII) form."""
    host = host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        raise ValueError(f"{host!r} is not a valid hostname") from None


def parse_allowed_domains(domains: Iterable[str] | None) -> frozenset[str] | None:
    """`allowed_media_domains` checked: bare hostnames or IP literals (no scheme, port or path). None or an empty
    list: no allow-list (public addresses only)."""
    if domains is None:
        return None
    if isinstance(domains, str):
        raise ValueError("allowed_media_domains must be a list of hostnames, not a string")
    allowed = set()
    for domain in domains:
        if not isinstance(domain, str) or not domain.strip():
            raise ValueError(f"allowed_media_domains entries must be non-empty hostnames, got {domain!r}")
        host = normalize_host(domain)
        if any(c in host for c in "/@?#") or (":" in host and not _is_ip_literal(host)):
            raise ValueError(f"allowed_media_domains entry {domain!r} must be a bare hostname or IP address "
                             "(no scheme, port or path)")
        allowed.add(host)
    return frozenset(allowed) or None


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv4-mapped (::ffff:a.b.c.d), NAT64 (64:ff9b::a.b.c.d) or 6to4 (2002:AABB:CCDD::)
    IPv6 address reaches; None for other addresses."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def is_public_address(address: IPAddress) -> bool:
    """True for globally routable unicast addresses: not loopback, private, link-local (cloud metadata included),
    unspecified, multicast, reserved or carrier-grade NAT, nor an IPv6 form of such an IPv4 address."""
    inner = embedded_ipv4(address)
    if inner is not None:
        return is_public_address(inner)
    if address.is_loopback or address.is_private or address.is_link_local or address.is_unspecified:
        return False
    if address.is_multicast or address.is_reserved or address in CARRIER_GRADE_NAT:
        return False
    if isinstance(address, ipaddress.IPv6Address) and (address.is_site_local or address.scope_id):
        return False
    return address.is_global


def _describe(address: IPAddress) -> str:
    inner = embedded_ipv4(address)
    return str(address) if inner is None else f"{address} (IPv4 {inner})"


def resolve(host: str, port: int, timeout_s: float) -> list[IPAddress]:
    """Every address `host` resolves to (an IP literal: itself), within timeout_s seconds."""
    if _is_ip_literal(host):
        return [ipaddress.ip_address(host)]
    result: list = []

    def lookup() -> None:
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, ValueError) as error:  # gaierror, or a name that cannot be encoded (IDNA, NUL)
            result.append(error)

    worker = threading.Thread(target=lookup, daemon=True, name="jvllm-media-dns")
    worker.start()
    worker.join(max(timeout_s, 0.0))
    if not result:
        raise TimeoutError(f"resolving {host!r} took longer than the fetch timeout")
    if isinstance(result[0], BaseException) or not result[0]:
        raise ValueError(f"could not resolve the image URL's host {host!r}")
    addresses = []
    for *_, sockaddr in result[0]:
        address = ipaddress.ip_address(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


@dataclasses.dataclass(frozen=True)
class Target:
    """A checked http(s) URL and the addresses it may be fetched from."""

    url: str
    scheme: str
    host: str  # normalized
    port: int
    path: str  # path and query, as sent in the request line
    addresses: tuple[IPAddress, ...]

    def pinned_url(self, address: IPAddress) -> str:
        """The URL with its host replaced by one checked address, so no second DNS lookup can change it."""
        literal = f"[{address}]" if address.version == 6 else str(address)
        return f"{self.scheme}://{literal}:{self.port}{self.path}"

    def headers(self) -> dict[str, str]:
        literal = f"[{self.host}]" if ":" in self.host else self.host
        return {"Host": literal if self.port == DEFAULT_PORTS[self.scheme] else f"{literal}:{self.port}"}

    def extensions(self) -> dict[str, str]:
        """httpx request extensions: TLS checks the certificate against the hostname, not the pinned address."""
        return {"sni_hostname": self.host} if self.scheme == "https" and not _is_ip_literal(self.host) else {}


class UrlPolicy:
    """Checks http(s) image URLs before each request (redirect targets included)."""

    def __init__(self, allowed_domains: Iterable[str] | None = None):
        self.allowed_domains = parse_allowed_domains(allowed_domains)

    def check(self, url: str, timeout_s: float) -> Target:
        """-> the URL's Target; ValueError naming the reason if it may not be fetched."""
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in DEFAULT_PORTS:
            raise ValueError(f"image URLs fetched over the network must be http or https, not {scheme or 'none'!r}")
        if parts.username is not None or parts.password is not None:
            raise ValueError("image URLs with credentials (user:password@) are refused")
        if not parts.hostname:
            raise ValueError(f"the image URL {url!r} has no host")
        try:
            port = parts.port or DEFAULT_PORTS[scheme]
        except ValueError:
            raise ValueError(f"the image URL {url!r} has an invalid port") from None
        host = normalize_host(parts.hostname)
        trusted = self._trusted(host)
        if not trusted and (host in BLOCKED_HOSTNAMES or host.endswith(".localhost")):
            raise ValueError(f"image URLs may not name the host {host!r} (a local or metadata service); an "
                             "operator can allow it with --allowed-media-domains")
        addresses = resolve(host, port, timeout_s)
        if not trusted:
            for address in addresses:
                if not is_public_address(address):
                    raise ValueError(f"image URLs may not reach the non-public address {_describe(address)} "
                                     f"(host {host!r}); only public addresses are fetched unless "
                                     "--allowed-media-domains lists the host")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return Target(url, scheme, host, port, path, tuple(addresses))

    def _trusted(self, host: str) -> bool:
        """True if the operator listed the host (it may then be private); ValueError if a list exists without it."""
        if self.allowed_domains is None:
            return False
        if host not in self.allowed_domains:
            raise ValueError(f"the image URL's host {host!r} is not in --allowed-media-domains")
        return True
