"""HTTPS (`--ssl-keyfile` / `--ssl-certfile`, vLLM's flags), client certificates (`--ssl-ca-certs`, `--ssl-cert-reqs`)
and `--root-path`: the openai client talks to the real app over TLS; files that are missing or not what they should
be are refused before the model loads."""
from __future__ import annotations

import datetime
import ipaddress
import ssl
import time
from pathlib import Path

import httpx
import pytest

from entrypoints.cli import main
from server.settings import ServerSettings
from tests.server.conftest import API_KEY, MODEL, start_server
from tests.server.minimal_app import serving


def _self_signed(folder: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost (its own CA) -> (certificate file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / f"{name}.crt", folder / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    folder = tmp_path_factory.mktemp("tls")
    return {"server": _self_signed(folder, "server"), "client": _self_signed(folder, "client")}


@pytest.fixture(scope="module")
def https_server(tiny_llama, tls_files):
    cert, key = tls_files["server"]
    server = start_server(tiny_llama, settings={"ssl_certfile": cert, "ssl_keyfile": key, "root_path": "/llm"})
    yield server
    server.stop()


def test_the_openai_client_completes_over_https(https_server, tls_files):
    from openai import OpenAI

    assert https_server.url.startswith("https://")
    verify = ssl.create_default_context(cafile=tls_files["server"][0])
    # closed after use: a TLS connection left open makes the server's shutdown wait for its close_notify
    with OpenAI(base_url=https_server.v1, api_key=API_KEY, http_client=httpx.Client(verify=verify)) as client:
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4
    with pytest.raises(httpx.ConnectError):  # an untrusted certificate is refused by a client that checks
        httpx.get(f"{https_server.url}/health")
    with pytest.raises(httpx.HTTPError):  # and plain HTTP gets no answer on the HTTPS port
        httpx.get(https_server.url.replace("https://", "http://") + "/health", timeout=5)


def test_the_root_path_prefixes_the_documented_server(https_server, tls_files):
    verify = ssl.create_default_context(cafile=tls_files["server"][0])
    spec = httpx.get(f"{https_server.url}/openapi.json", verify=verify).json()
    assert spec["servers"] == [{"url": "/llm"}]


def test_required_client_certificates_are_checked_against_the_ca_certs(tls_files):
    (server_cert, server_key), (client_cert, client_key) = tls_files["server"], tls_files["client"]
    with serving(ssl_certfile=server_cert, ssl_keyfile=server_key, ssl_ca_certs=client_cert,
                 ssl_cert_reqs=ssl.CERT_REQUIRED) as port:
        url = f"https://127.0.0.1:{port}/"
        with_certificate = ssl.create_default_context(cafile=server_cert)
        with_certificate.load_cert_chain(client_cert, client_key)
        assert httpx.get(url, verify=with_certificate).text == "ok"
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            httpx.get(url, verify=ssl.create_default_context(cafile=server_cert))
        stranger = ssl.create_default_context(cafile=server_cert)  # a certificate the CA file does not hold
        stranger.load_cert_chain(server_cert, server_key)
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=stranger)


def test_bad_tls_settings_are_refused_with_what_is_wrong(tls_files, tmp_path):
    cert, key = tls_files["server"]
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    cases = [
        (dict(ssl_keyfile=key), "both --ssl-keyfile and --ssl-certfile"),
        (dict(ssl_certfile=cert, ssl_keyfile=str(tmp_path / "missing.key")), "no such file"),
        (dict(ssl_certfile=str(garbage), ssl_keyfile=key), "not a certificate and its private key"),
        (dict(ssl_certfile=cert, ssl_keyfile=tls_files["client"][1]), "not a certificate and its private key"),
        (dict(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=str(garbage)), "--ssl-ca-certs: not CA"),
        (dict(ssl_cert_reqs=2), "need HTTPS"),
    ]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message):
            ServerSettings(["m"], **settings)


def test_the_cli_refuses_bad_tls_flags_before_loading_the_model(tls_files, capsys):
    started = time.monotonic()
    assert main(["serve", "--ssl-keyfile", tls_files["server"][1]]) == 2
    assert "both --ssl-keyfile and --ssl-certfile" in capsys.readouterr().err
    assert time.monotonic() - started < 5  # no model was loaded
