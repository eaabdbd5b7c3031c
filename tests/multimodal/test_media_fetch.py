"""Image URL fetching is safe by default: only public addresses (or the operator's allowed hosts), the checked address
is the one connected to, redirects are checked again, downloads are bounded in bytes and total time, and decoded
images in pixels. No model needed."""
from __future__ import annotations

import base64
import http.server
import io
import ipaddress
import socket
import threading
import time
import urllib.parse

import pytest

from jvllm.multimodal.http_fetch import MAX_REDIRECTS
from jvllm.multimodal.inputs import engine_multimodal
from jvllm.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS, MediaLoader, decode_image
from jvllm.multimodal.url_policy import Target, UrlPolicy

LOCAL = ["127.0.0.1"]


def _png(width: int = 8, height: int = 8, mode: str = "RGB") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves a small PNG, redirects, oversized bodies, and servers that send slowly; records every request."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str]] = []  # (path, Host header)
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802
        with self.lock:
            self.seen.append((self.path, self.headers.get("Host", "")))
        parts = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parts.query)
        try:
            self._route(parts.path, query)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the client gave up (a deadline): nothing more to send

    def _route(self, path: str, query: dict[str, list[str]]) -> None:
        if path == "/ok.png":
            self._send(200, PNG)
        elif path == "/redirect":
            self._redirect(query["to"][0])
        elif path.startswith("/chain/"):
            left = int(path.rsplit("/", 1)[1])
            self._redirect(f"/chain/{left - 1}" if left else "/ok.png") if left else self._send(200, PNG)
        elif path == "/big.png":
            self._send(200, PNG + b"\0" * 5000)
        elif path == "/big-undeclared.png":
            self._send_undeclared(PNG + b"\0" * 5000)
        elif path == "/drip.png":
            self._drip_body()
        elif path == "/drip-headers.png":
            self._drip_headers()
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_undeclared(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Connection", "close")  # the body ends when the connection does: no Content-Length
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _drip_body(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        for _ in range(200):  # a byte every 50 ms: every read returns long before a per-read timeout
            self.wfile.write(b"\0")
            self.wfile.flush()
            time.sleep(0.05)

    def _drip_headers(self) -> None:
        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(200):
            self.wfile.write(f"X-Slow-{i}: a\r\n".encode())
            self.wfile.flush()
            time.sleep(0.05)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def seen(server) -> list[tuple[str, str]]:
    """The requests the server receives during one test."""
    with _Handler.lock:
        _Handler.seen.clear()
    return _Handler.seen


@pytest.fixture
def offline(monkeypatch):
    """Any connection attempt or DNS lookup fails the test; fake_dns(name -> addresses) answers lookups."""
    def no_connection(*args, **kwargs):
        raise AssertionError("a refused URL must not open a connection")

    def no_dns(host, *args, **kwargs):
        raise AssertionError(f"unexpected DNS lookup of {host!r}")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    return lambda names: monkeypatch.setattr(socket, "getaddrinfo", _fake_getaddrinfo(names))


def _fake_getaddrinfo(names: dict[str, list[str]]):
    def getaddrinfo(host, port, *args, **kwargs):
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in names[host]]

    return getaddrinfo


def test_loopback_is_refused_by_default_without_a_request(server, seen):
    with pytest.raises(ValueError, match="non-public address 127.0.0.1.*--allowed-media-domains"):
        MediaLoader().load_image(f"{server}/ok.png")
    assert seen == []


def test_a_listed_host_may_be_loopback(server, seen):
    image = MediaLoader(allowed_media_domains=LOCAL).load_image(f"{server}/ok.png")
    assert image.size == (8, 8)
    assert seen == [("/ok.png", server.removeprefix("http://"))]


def test_hosts_not_in_the_allow_list_are_refused(server, seen):
    with pytest.raises(ValueError, match="'127.0.0.1' is not in --allowed-media-domains"):
        MediaLoader(allowed_media_domains=["images.example.com"]).load_image(f"{server}/ok.png")
    assert seen == []


@pytest.mark.parametrize("host", [
    "10.0.0.1", "172.16.5.4", "192.168.1.1", "127.0.0.2", "169.254.169.254", "100.64.0.1", "0.0.0.0", "224.0.0.1",
    "255.255.255.255", "240.0.0.1", "[::1]", "[::]", "[fe80::1]", "[fc00::1]", "[fd12:3456::1]", "[ff02::1]",
    "[::ffff:127.0.0.1]", "[::ffff:169.254.169.254]", "[::ffff:10.0.0.1]", "[64:ff9b::a00:1]",
    "[64:ff9b::7f00:1]", "[2002:a9fe:a9fe::1]", "[2002:7f00:1::]", "[::7f00:1]",
])
def test_non_public_ip_literals_are_refused_offline(offline, host):
    with pytest.raises(ValueError, match="non-public address"):
        MediaLoader().load_image(f"http://{host}/latest/meta-data")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "metadata.google.internal", "api.localhost",
                                  "instance-data"])
def test_local_and_metadata_names_are_refused_before_any_lookup(offline, host):
    with pytest.raises(ValueError, match="local or metadata service"):
        MediaLoader().load_image(f"https://{host}/computeMetadata/v1/")


def test_names_resolving_to_private_addresses_are_refused(offline):
    offline({"intranet.example.com": ["10.1.2.3"], "mixed.example.com": ["93.184.216.34", "192.168.0.7"],
             "mapped.example.com": ["::ffff:127.0.0.1"]})
    for host, address in [("intranet", "10.1.2.3"), ("mixed", "192.168.0.7"), ("mapped", r"\S+ \(IPv4 127.0.0.1\)")]:
        with pytest.raises(ValueError, match=f"non-public address {address} "):
            MediaLoader().load_image(f"http://{host}.example.com/cat.png")
    with pytest.raises(ValueError, match="could not resolve"):
        MediaLoader().load_image("http://nowhere.example.com/cat.png")


def test_a_public_name_is_pinned_to_its_checked_address(offline):
    offline({"images.example.com": ["93.184.216.34"]})
    target = UrlPolicy().check("https://Images.Example.com/a/cat.png?size=2#frag", 1.0)
    assert target.pinned_url(target.addresses[0]) == "https://93.184.216.34:443/a/cat.png?size=2"
    assert target.headers() == {"Host": "images.example.com"}
    assert target.extensions() == {"sni_hostname": "images.example.com"}  # TLS checks the name, not the address
    plain = UrlPolicy().check("http://images.example.com:8080/cat.png", 1.0)
    assert plain.headers() == {"Host": "images.example.com:8080"} and plain.extensions() == {}


def test_the_connection_goes_to_the_address_that_was_checked(server, seen, monkeypatch):
    """A listed name resolved once: a second answer (DNS rebinding) is never asked for; Host names the name."""
    real, answers = socket.getaddrinfo, iter(["127.0.0.1", "10.9.9.9"])

    def rebinding(host, port, *args, **kwargs):
        return real(next(answers) if host == "img.test" else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    port = server.rsplit(":", 1)[1]
    assert MediaLoader(allowed_media_domains=["img.test"]).load_image(f"http://img.test:{port}/ok.png").size == (8, 8)
    assert seen == [("/ok.png", f"img.test:{port}")]
    assert next(answers) == "10.9.9.9"  # asked once


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """The same handler over TLS with a self-signed certificate for the name img.test -> (base URL's port, CA file)."""
    import ssl
    import subprocess

    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=img.test", "-addext", "subjectAltName=DNS:img.test"],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], cert
    httpd.shutdown()
    httpd.server_close()


def test_https_to_the_pinned_address_checks_the_certificate_against_the_name(tls_server, monkeypatch):
    import ssl

    from jvllm.multimodal import http_fetch

    port, cert = tls_server
    monkeypatch.setattr(http_fetch, "_ssl_context", lambda: ssl.create_default_context(cafile=str(cert)))
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kwargs: real(
        "127.0.0.1" if host in ("img.test", "other.test") else host, *args, **kwargs))
    loader = MediaLoader(allowed_media_domains=["img.test", "other.test", "127.0.0.1"])
    assert loader.load_image(f"https://img.test:{port}/ok.png").size == (8, 8)
    for host in ("other.test", "127.0.0.1"):  # same address, but the certificate names img.test only
        with pytest.raises(ValueError, match="fetching the image failed: .*certificate"):
            loader.load_image(f"https://{host}:{port}/ok.png")


def test_redirects_are_checked_again(server, seen):
    loader = MediaLoader(allowed_media_domains=LOCAL)
    port = server.rsplit(":", 1)[1]
    assert loader.load_image(f"{server}/redirect?to=/ok.png").size == (8, 8)  # same host: fine
    for location, reason in [(f"http://localhost:{port}/ok.png", "'localhost' is not in --allowed-media-domains"),
                             ("http://169.254.169.254/latest/meta-data", "not in --allowed-media-domains"),
                             (f"http://[::1]:{port}/ok.png", "not in --allowed-media-domains"),
                             ("file:///etc/passwd", "must be http or https"),
                             ("gopher://127.0.0.1/", "must be http or https")]:
        with pytest.raises(ValueError, match=f"redirected to .*refused: .*{reason}"):
            loader.load_image(f"{server}/redirect?to={urllib.parse.quote(location)}")
    assert [path.split("?")[0] for path, _ in seen] == ["/redirect", "/ok.png"] + ["/redirect"] * 5


def test_a_redirect_from_a_public_host_to_loopback_is_refused(server, seen):
    """Without an allow-list: a public host (the test server standing in for one) redirects to loopback."""
    class PublicTestServer(UrlPolicy):
        def check(self, url: str, timeout_s: float) -> Target:
            if url.startswith("http://cdn.example.com/"):
                return Target(url, "http", "cdn.example.com", port, url[len("http://cdn.example.com"):],
                              (ipaddress.ip_address("127.0.0.1"),))
            return super().check(url, timeout_s)

    port = int(server.rsplit(":", 1)[1])
    loader = MediaLoader()
    loader.url_policy = PublicTestServer()
    assert loader.load_image("http://cdn.example.com/ok.png").size == (8, 8)
    for location in (f"{server}/ok.png", f"http://localhost:{port}/ok.png", "http://169.254.169.254/"):
        with pytest.raises(ValueError, match="redirected to .*, which is refused"):
            loader.load_image(f"http://cdn.example.com/redirect?to={urllib.parse.quote(location)}")
    assert [path.split("?")[0] for path, _ in seen] == ["/ok.png"] + ["/redirect"] * 3


def test_redirect_chains_are_bounded(server, seen):
    loader = MediaLoader(allowed_media_domains=LOCAL)
    assert loader.load_image(f"{server}/chain/{MAX_REDIRECTS}").size == (8, 8)
    seen.clear()
    with pytest.raises(ValueError, match=f"redirected more than {MAX_REDIRECTS} times"):
        loader.load_image(f"{server}/chain/{MAX_REDIRECTS + 1}")
    assert len(seen) == MAX_REDIRECTS + 1  # the sixth redirect is not followed


@pytest.mark.parametrize("path", ["/drip.png", "/drip-headers.png"])
def test_a_slow_server_is_cut_off_by_the_total_deadline(server, path):
    loader = MediaLoader(allowed_media_domains=LOCAL, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(ValueError, match="timed out after 1.0 s"):
        loader.load_image(server + path)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("path", ["/big.png", "/big-undeclared.png"])
def test_oversized_downloads_are_refused(server, path):
    with pytest.raises(ValueError, match="larger than 4000 bytes"):
        MediaLoader(allowed_media_domains=LOCAL, max_bytes=4000).load_image(server + path)


def test_huge_images_are_refused_from_their_header(monkeypatch):
    from PIL import ImageFile

    huge = _png(8000, 8000, "1")  # 64 million pixels in a few KB
    assert len(huge) < 64_000
    url = "data:image/png;base64," + base64.b64encode(huge).decode()
    with monkeypatch.context() as patch:
        patch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded before the size check"))
        with pytest.raises(ValueError, match=r"8000x8000 = 64000000 pixels, over the limit of 16777216 "
                                             r"\(max_image_pixels, --max-image-pixels\)"):
            MediaLoader().load_image(url)
    assert MediaLoader(max_image_pixels=64_000_000).load_image(url).size == (8000, 8000)


def test_pils_own_decompression_bomb_checks_become_value_errors(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for side in (40, 100):  # over PIL's limit (a warning), over twice it (an error)
        with pytest.raises(ValueError, match="decompression-bomb limit of 1000 pixels"):
            decode_image(_png(side, side, "L"), max_pixels=1 << 20)
        with pytest.raises(ValueError, match="over the limit of 100 pixels"):
            decode_image(_png(side, side, "L"), max_pixels=100)


def test_data_urls_are_bounded_before_decoding(monkeypatch):
    loader = MediaLoader(max_bytes=1000)
    big = base64.b64encode(b"\0" * 1001).decode()
    assert loader.load_image("data:image/png;base64," + base64.b64encode(PNG).decode()).size == (8, 8)
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: pytest.fail("decoded before the size check"))
    for url in ("data:image/png;base64," + big + "AAAA", "data:image/png," + "%00" * 1001 + "x" * 2000):
        with pytest.raises(ValueError, match="data URL's image is larger than 1000 bytes"):
            loader.load_image(url)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="larger than 1000 bytes"):  # just past the limit once decoded
        loader.load_image("data:image/png;base64," + big)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "16m", None])
def test_max_image_pixels_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="max_image_pixels must be a positive integer"):
        MediaLoader(max_image_pixels=value)


def test_allowed_media_domains_are_bare_hosts():
    assert UrlPolicy(["Images.Example.COM.", "[::1]", "127.0.0.1"]).allowed_domains == frozenset(
        {"images.example.com", "::1", "127.0.0.1"})
    assert UrlPolicy([]).allowed_domains is None  # as vLLM: an empty list sets no allow-list
    for bad, reason in [("images.example.com", "not a string"), (["https://images.example.com"], "bare hostname"),
                        (["images.example.com:8080"], "bare hostname"), ([""], "non-empty")]:
        with pytest.raises(ValueError, match=reason):
            UrlPolicy(bad)


def test_urls_with_credentials_or_odd_schemes_are_refused(offline):
    for url, reason in [("http://user:secret@images.example.com/cat.png", "credentials"),
                        ("http:///cat.png", "has no host"), ("http://images.example.com:99999/", "invalid port")]:
        with pytest.raises(ValueError, match=reason):
            MediaLoader().load_image(url)


def test_engine_and_cli_settings_reach_the_loader():
    from types import SimpleNamespace

    from entrypoints.cli import build_parser
    from jvllm.engine.arg_utils import EngineArgs

    assert EngineArgs().allowed_media_domains is None
    assert EngineArgs().max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS == 4096 * 4096
    defaults = vars(EngineArgs.from_cli_args(build_parser().parse_args(["serve"])))
    assert defaults["allowed_media_domains"] is None and defaults["max_image_pixels"] == DEFAULT_MAX_IMAGE_PIXELS
    kwargs = vars(EngineArgs.from_cli_args(build_parser().parse_args(
        ["serve", "--allowed-media-domains", "images.example.com", "10.0.0.5", "--max-image-pixels", "64m"])))
    assert kwargs["allowed_media_domains"] == ["images.example.com", "10.0.0.5"]
    assert kwargs["max_image_pixels"] == 64 << 20
    _, _, media = engine_multimodal(SimpleNamespace(vision=None), 256, None, None, None,
                                    allowed_media_domains=kwargs["allowed_media_domains"],
                                    max_image_pixels=kwargs["max_image_pixels"])
    assert media.url_policy.allowed_domains == frozenset({"images.example.com", "10.0.0.5"})
    assert media.max_image_pixels == 64 << 20
