"""A loopback HTTP proxy in front of an S3 server that refuses every write, as a read-only
bucket policy would.

``GET`` and ``HEAD`` (object reads, ``HeadObject``, ``ListObjectsV2``) go through to the
real server; ``PUT``, ``POST`` and ``DELETE`` are answered ``403 AccessDenied`` with
S3's XML error body, never forwarded, and counted. LocalStack does not enforce IAM
policies, so this is how a test gives a Bulletin reader an S3 origin it cannot write.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied (a read-only test proxy)</Message></Error>"
)
#: Hop-by-hop headers (RFC 9110, section 7.6.1) are not relayed.
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}


class ReadOnlyProxy:
    """Relays reads to ``upstream`` (``http://host:port``); refuses writes. ``refused``
    lists ``"METHOD path"`` of every write refused."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self.refused: list[str] = []
        self.relayed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as boto3 expects

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _deny(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)  # the body is discarded, never forwarded
                with proxy._lock:
                    proxy.refused.append(f"{self.command} {self.path}")
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(_DENIED)))
                self.end_headers()
                self.wfile.write(_DENIED)

            def _relay(self) -> None:
                connection = http.client.HTTPConnection(*proxy._upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    connection.request(self.command, self.path, headers=headers)
                    response = connection.getresponse()
                    body = response.read()
                finally:
                    connection.close()
                with proxy._lock:
                    proxy.relayed += 1
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            # http.server's dispatch names (do_<METHOD>).
            do_GET = do_HEAD = _relay  # noqa: N815
            do_PUT = do_POST = do_DELETE = _deny  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="read-only-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
