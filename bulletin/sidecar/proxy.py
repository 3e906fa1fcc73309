"""Forwarding one admitted request to the engine and streaming its answer back.

Bodies are relayed chunk by chunk as they arrive (``iter_any``), never buffered, so
server-sent events reach the client token by token. Hop-by-hop headers are dropped in
both directions; the engine's ``Content-Encoding`` is passed through untouched (the
client session does not decompress). The response carries the version that served it
in ``X-Bulletin-Version`` from its first byte. If an activation had to go ahead while
an event stream was still running (its drain timeout expired), the stream ends with
the SSE comment line ``: bulletin-version-changed served=<old> active=<new>``, which
OpenAI-compatible clients ignore (comments are skipped by the SSE specification) and
Bulletin-aware clients can look for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, MultiDict
from yarl import URL

from bulletin.sidecar.gate import Lease
from bulletin.sidecar.requirements import (
    HEADER_EXACT,
    HEADER_HEAD,
    HEADER_MAX_WAIT,
    HEADER_MIN,
    HEADER_SERVED,
)

__all__ = ["HOP_BY_HOP", "ProxyOutcome", "forward", "version_changed_comment"]

log = logging.getLogger("bulletin.sidecar")

#: RFC 9110 section 7.6.1, plus the de-facto ones proxies never forward.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_OWN_REQUEST_HEADERS: Final = frozenset(
    h.lower() for h in (HEADER_MIN, HEADER_EXACT, HEADER_MAX_WAIT, "host", "content-length")
)


class ProxyOutcome:
    """How a forwarded request ended: the status for metrics and whether it failed."""

    __slots__ = ("status", "upstream_failed")

    def __init__(self, status: int, *, upstream_failed: bool = False) -> None:
        self.status = status
        self.upstream_failed = upstream_failed


def version_changed_comment(served: int, active: int | None) -> bytes:
    """The SSE comment appended to a stream that outlived an activation."""
    return f": bulletin-version-changed served={served} active={active}\n\n".encode()


def _request_headers(request: web.Request) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    connection_tokens = {t.strip().lower() for t in request.headers.get("Connection", "").split(",") if t.strip()}
    for name, value in request.headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in _OWN_REQUEST_HEADERS or lower in connection_tokens:
            continue
        headers.add(name, value)
    peer = request.remote or ""
    prior = request.headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    headers["X-Forwarded-Proto"] = request.scheme
    if request.host:
        headers["X-Forwarded-Host"] = request.host
    return headers


def _response_headers(upstream: aiohttp.ClientResponse, *, sse: bool) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    connection_tokens = {t.strip().lower() for t in upstream.headers.get("Connection", "").split(",") if t.strip()}
    for name, value in upstream.headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in connection_tokens:
            continue
        if lower == "content-length" and sse:
            continue  # we may append a comment to the stream
        headers.add(name, value)
    return headers


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    upstream: URL,
    query: MultiDict[str],
    body: bytes,
    lease: Lease,
    *,
    head_version: int | None,
    active_version: Callable[[], int | None],
    error: Callable[[int, str, str], web.Response],
) -> tuple[web.StreamResponse, ProxyOutcome]:
    """Relay ``request`` to ``upstream`` while ``lease`` is held.

    ``error(status, code, message)`` builds the sidecar's JSON error responses (502 when
    the engine cannot be reached, 504 when it does not answer in time).
    """
    url = upstream.with_path(upstream.raw_path.rstrip("/") + request.rel_url.raw_path, encoded=True).with_query(query)
    try:
        upstream_response = await session.request(
            request.method,
            url,
            headers=_request_headers(request),
            data=body if body else None,
            allow_redirects=False,
        )
    except TimeoutError:
        return error(504, "upstream_timeout", "the engine did not answer in time"), ProxyOutcome(
            504, upstream_failed=True
        )
    except (aiohttp.ClientError, OSError) as exc:
        message = f"the engine at {upstream} cannot be reached: {exc.__class__.__name__}: {exc}"
        return error(502, "upstream_unavailable", message), ProxyOutcome(502, upstream_failed=True)

    async with upstream_response:
        content_type = upstream_response.headers.get("Content-Type", "")
        sse = content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
        response = web.StreamResponse(
            status=upstream_response.status,
            reason=upstream_response.reason,
            headers=_response_headers(upstream_response, sse=sse),
        )
        response.headers[HEADER_SERVED] = str(lease.version)
        if head_version is not None:
            response.headers[HEADER_HEAD] = str(head_version)
        try:
            await response.prepare(request)
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
            if sse and lease.preempted:
                await response.write(version_changed_comment(lease.version, active_version()))
            await response.write_eof()
        except ConnectionResetError:
            # The client went away; leaving the block closes the engine's connection too,
            # which is how OpenAI-compatible servers learn to stop generating.
            return response, ProxyOutcome(499)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("engine failed mid-response (%s); closing the client connection", exc)
            if request.transport is not None:
                request.transport.close()  # a truncated body must not look complete
            return response, ProxyOutcome(502, upstream_failed=True)
    return response, ProxyOutcome(upstream_response.status)
