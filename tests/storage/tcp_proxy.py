"""A loopback TCP proxy that can lose a response, or a request, on the way.

Real bytes to a real server. Losing a *response*: the request reaches the server
in full and is applied there; only the answer is swallowed and the client's
connection closed, as a load balancer or a flaky network would. This is the
failure that makes botocore re-send a conditional PUT which already succeeded.
Losing a *request*: the connection closes before anything reaches the server.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Self

_CHUNK = 64 * 1024


class ResponseDroppingProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``; :meth:`drop_next_response` arms it."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed = 0
        self._dropped = 0
        self._requests_armed = 0
        self._requests_dropped = 0
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        """The proxy's HTTP endpoint URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def dropped(self) -> int:
        """How many responses were swallowed so far."""
        with self._lock:
            return self._dropped

    @property
    def requests_dropped(self) -> int:
        """How many requests were swallowed so far."""
        with self._lock:
            return self._requests_dropped

    def drop_next_response(self, count: int = 1) -> None:
        """Swallow the next ``count`` responses (after their requests reached the server)."""
        with self._lock:
            self._armed += count

    def drop_next_request(self, count: int = 1) -> None:
        """Close the connection on the next ``count`` requests, forwarding nothing."""
        with self._lock:
            self._requests_armed += count

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self._upstream, timeout=30)
            with self._lock:
                self._sockets += [client, upstream]
            for target, args in ((self._pump_requests, (client, upstream)), (self._pump_responses, (upstream, client))):
                thread = threading.Thread(target=target, args=args, daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump_requests(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while chunk := client.recv(_CHUNK):
                with self._lock:
                    # Armed between requests (the tests make one at a time), so the
                    # next chunk on any connection is the head of the next request.
                    drop = self._requests_armed > 0
                    if drop:
                        self._requests_armed -= 1
                        self._requests_dropped += 1
                if drop:
                    _close(client)
                    return
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _pump_responses(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while chunk := upstream.recv(_CHUNK):
                with self._lock:
                    # The server answers only after it read the whole request, so
                    # the request was applied. A "100 Continue" is not the answer.
                    drop = self._armed > 0 and not chunk.startswith(b"HTTP/1.1 100")
                    if drop:
                        self._armed -= 1
                        self._dropped += 1
                if drop:
                    return
                client.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed.set()
        self._listener.close()
        self._acceptor.join(5)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _close(sock)
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
