"""https through the pinned connection: the socket goes to the vetted address, TLS keeps the name.

A loopback TLS origin holds a certificate for ``media.test`` from a test CA.
The fake resolver answers a public address for the name; the test socket
layer routes that address to the loopback origin.  SNI and certificate
verification must use ``media.test`` (the URL's name), not the address.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.config.settings import FetchSettings
from tests.media.netfakes import FakeResolver, LoopbackOnlyBackend

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

PUBLIC = "93.184.216.34"
BODY = b"tls-body" * 32


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_pki(folder: Path, dns_name: str) -> tuple[Path, Path, Path]:
    """A CA and a leaf certificate for ``dns_name``; returns (ca.pem, leaf.pem, leaf.key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("mmgate test CA")).issuer_name(_name("mmgate test CA"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(_name(dns_name)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "leaf.pem", folder / "leaf.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@dataclass
class TlsOrigin:
    port: int
    ca: Path
    sni: list[str | None] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)


@pytest.fixture
def tls_origin(tmp_path: Path) -> Iterator[TlsOrigin]:
    ca, cert, key = _write_pki(tmp_path, "media.test")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    origin = TlsOrigin(port=0, ca=ca)
    ctx.sni_callback = lambda _sock, name, _ctx: origin.sni.append(name)  # type: ignore[assignment,misc]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            origin.hosts.append(self.headers.get("Host", ""))
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    server.daemon_threads = True
    origin.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield origin
    finally:
        server.shutdown()
        server.server_close()


def _fetch(origin: TlsOrigin, url: str, table: dict[str, list[str]]) -> tuple[bytes | GatewayError, LoopbackOnlyBackend]:
    backend = LoopbackOnlyBackend({(PUBLIC, 443): origin.port})
    client_ctx = ssl.create_default_context(cafile=str(origin.ca))
    fetcher = MediaFetcher(FetchSettings(), resolver=FakeResolver(table), network_backend=backend,
                           ssl_context=client_ctx)

    async def go() -> bytes | GatewayError:
        try:
            return await fetcher.fetch(url, 1 << 20)
        except GatewayError as exc:
            return exc
        finally:
            await fetcher.aclose()

    return asyncio.run(go()), backend


def test_https_connects_to_the_pinned_address_with_sni_and_verification_for_the_name(tls_origin: TlsOrigin) -> None:
    result, backend = _fetch(tls_origin, "https://media.test/a.png", {"media.test": [PUBLIC]})
    assert result == BODY
    assert backend.calls == [(PUBLIC, 443)]  # the socket went to the checked address
    assert tls_origin.sni == ["media.test"]  # SNI is the URL's name
    assert tls_origin.hosts == ["media.test"]


def test_https_certificate_for_another_name_is_refused(tls_origin: TlsOrigin) -> None:
    result, _ = _fetch(tls_origin, "https://other.test/a.png", {"other.test": [PUBLIC]})
    assert isinstance(result, GatewayError)
    assert result.code is ErrorCode.MEDIA_FETCH_FAILED and result.status == 400  # not retryable: it will not heal
    assert tls_origin.sni == ["other.test"] and tls_origin.hosts == []
