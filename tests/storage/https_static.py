"""A real static-file server on loopback HTTPS, as a CDN or static site serves a bucket.

aiohttp's static handler (``web.static``: ETags ``"<mtime ns>-<size>"``, ``304`` for a
matching ``If-None-Match``, directory indexes) over a directory, on 127.0.0.1 with a
self-signed certificate made here, in its own thread and event loop. Every request is
logged (method, path, ``If-None-Match``, status), so tests can count what a client sent.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["Request", "StaticHttpsServer", "self_signed_certificate"]


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    if_none_match: str | None
    status: int


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """``(cert.pem, key.pem)`` for 127.0.0.1 and localhost, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bulletin test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class StaticHttpsServer:
    """Serves ``root`` at ``https://127.0.0.1:<port><prefix>/`` until closed (a context manager)."""

    def __init__(self, root: Path, certificate_dir: Path, *, prefix: str = "/bucket", show_index: bool = True) -> None:
        self.root = root
        self.prefix = prefix
        self.cert_file, key_file = self_signed_certificate(certificate_dir)
        self._server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_ssl.load_cert_chain(self.cert_file, key_file)
        self._show_index = show_index
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="https-static", daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}{self.prefix}"

    def client_ssl(self) -> ssl.SSLContext:
        """A client context that trusts this server's certificate (and nothing else)."""
        return ssl.create_default_context(cafile=str(self.cert_file))

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    async def _log(self, request: web.Request, response: web.StreamResponse) -> None:
        # on_response_prepare: the status as sent (a FileResponse turns into a 304 only here).
        seen = Request(request.method, request.path, request.headers.get("If-None-Match"), response.status)
        with self._lock:
            self._requests.append(seen)

    async def _start(self) -> None:
        app = web.Application()
        app.on_response_prepare.append(self._log)
        app.router.add_static(self.prefix, self.root, show_index=self._show_index)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._server_ssl)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def __enter__(self) -> StaticHttpsServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
