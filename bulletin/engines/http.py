"""Blocking JSON over HTTP for engine control endpoints (standard library only).

Engine adapters run on the sidecar's sync thread, where a blocking call is the simple
and right thing; every failure becomes an :class:`~bulletin.errors.EngineError` that
names the endpoint.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Final

from bulletin.errors import ConfigError, EngineError

__all__ = ["MAX_RESPONSE_BYTES", "engine_url", "request_json"]

#: Control endpoints answer small JSON documents; anything bigger is not one of them.
MAX_RESPONSE_BYTES: Final = 16 << 20


def engine_url(base: str) -> str:
    """``base`` without a trailing slash, checked to be an http(s) URL."""
    if not isinstance(base, str) or not base.startswith(("http://", "https://")):
        raise ConfigError(f"engine URL must start with http:// or https://, got {base!r}")
    return base.rstrip("/")


def request_json(
    method: str,
    url: str,
    payload: Any = None,
    *,
    timeout: float,
    ok_statuses: tuple[int, ...] = (200,),
    text: bool = False,
) -> tuple[int, Any]:
    """Send ``payload`` as JSON and return ``(status, decoded body or None)``.

    Statuses outside ``ok_statuses`` are returned too when the body is JSON (engines
    explain refusals in it); unreachable engines, timeouts, non-JSON error bodies and
    oversized bodies raise ``EngineError``. With ``text``, a body that is not JSON is
    returned as text, whatever the status (endpoints that answer in plain text).
    """
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    req.add_header("Accept", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read(MAX_RESPONSE_BYTES + 1)
    except OSError as exc:  # URLError, timeouts and refused connections are all OSErrors
        reason = getattr(exc, "reason", exc)
        raise EngineError(f"{method} {url}: engine unreachable: {reason}") from exc
    if len(raw) > MAX_RESPONSE_BYTES:
        raise EngineError(f"{method} {url}: response larger than {MAX_RESPONSE_BYTES} bytes")
    body: Any = None
    if raw:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if text:
                return status, raw.decode("utf-8", errors="replace")
            if status in ok_statuses:
                raise EngineError(f"{method} {url}: answered {status} with a body that is not JSON") from None
            raise EngineError(f"{method} {url}: HTTP {status}: {raw[:200]!r}") from None
    return status, body
