"""The version-aware sidecar: an HTTP reverse proxy in front of an OpenAI-compatible engine.

>>> metrics = SidecarMetrics()
>>> target = GatedTarget(TorchTarget.from_module(model), metrics)
>>> subscriber = Subscriber("s3://bucket/runs", "grpo", target=target, on_bytes=metrics.bytes_downloaded.inc)
>>> sidecar = Sidecar(subscriber, "http://127.0.0.1:8001", target=target, metrics=metrics)
>>> web.run_app(sidecar.create_app(), port=8000)

Requests to the inference API (an allow-list, :attr:`SidecarConfig.forward`: completions,
chat completions, models, health) are admitted through the activation gate (see
:mod:`bulletin.sidecar.gate`) with the requirement their headers or query string state
(:mod:`bulletin.sidecar.requirements`), then relayed to the engine
(:mod:`bulletin.sidecar.proxy`). Every other path, an engine's control endpoints
included (``/collective_rpc``, ``/update_weights_from_disk``, ``/flush_cache``, ...),
is answered 404 by the sidecar without contacting the engine; the sidecar's own
endpoints (``/healthz``, ``/readyz``, ``/version``, ``/metrics``) only read. A
background :class:`SyncWorker` follows the run. The HTTP contract is specified in docs/SIDECAR.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from aiohttp import web
from multidict import MultiDict
from yarl import URL

from bulletin.errors import ConfigError, InvalidInput
from bulletin.sidecar.gate import ActivationGate, Lease, Refusal
from bulletin.sidecar.metrics import CONTENT_TYPE, SidecarMetrics
from bulletin.sidecar.proxy import forward
from bulletin.sidecar.requirements import (
    HEADER_HEAD,
    HEADER_SERVED,
    VersionRequirement,
    parse_requirement,
)
from bulletin.sidecar.worker import GateBridge, GatedTarget, SubscriberLike, SyncStatus, SyncWorker

__all__ = ["INTERNAL_PATHS", "Sidecar", "SidecarConfig", "create_app"]

log = logging.getLogger("bulletin.sidecar")

#: Paths the sidecar answers itself.
INTERNAL_PATHS: Final = ("/healthz", "/readyz", "/version", "/metrics")

#: The inference API relayed to the engine by default (OpenAI-compatible servers: vLLM,
#: SGLang, the built-in torch server). A path ending in ``/*`` also allows every path
#: below it. Anything else, the engines' control endpoints first of all, is never relayed.
DEFAULT_FORWARD: Final = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/*", "/health")

#: ``/`` and segments of unreserved characters and ``:@!$&'()*+,;=``, none of them ``.``
#: or ``..`` (RFC 3986's pchar without percent-encoding).
_PLAIN_PATH: Final = re.compile(r"(?:/(?!\.{1,2}(?:/|$))[A-Za-z0-9\-._~:@!$&'()*+,;=]+)+")

_REFUSAL_STATUS: Final = {"behind": 409, "gone": 410, "not_ready": 503, "busy": 503}
_REFUSAL_CODE: Final = {
    "behind": "version_behind",
    "gone": "version_gone",
    "not_ready": "not_ready",
    "busy": "activation_in_progress",
}


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Tunables; every duration is in seconds."""

    default_wait: float = 10.0
    """Wait allowed to a request that needs a newer version and names no budget."""
    max_wait: float = 60.0
    """Cap on any request's wait, whatever it asks for."""
    poll_interval: float = 1.0
    """Head polls while nobody waits (one conditional GET each)."""
    eager_interval: float = 0.05
    """Head polls while a request waits for a version newer than the active one."""
    drain_timeout: float | None = 30.0
    """How long an activation waits for requests in flight; None waits for ever."""
    max_backoff: float = 30.0
    """Longest pause between retries after failed polls or syncs."""
    connect_timeout: float = 5.0
    """Connecting to the engine; a refused or timed-out connect answers 502."""
    read_timeout: float | None = None
    """Longest silence from the engine inside a response (None: generations take what they take)."""
    max_request_bytes: int = 64 << 20
    forward: tuple[str, ...] = DEFAULT_FORWARD
    """Paths relayed to the engine (exact, or a prefix ending in ``/*``); every other path
    is answered 404 by the sidecar and never reaches the engine."""
    verify_interval: float = 3600.0
    """Seconds between full re-hashes of the bits the engine serves against their version
    (also run once at start, before the first sync); damaged bits are rebuilt from a
    keyframe. The check reads the whole model on the follow thread: requests are served
    meanwhile, syncs wait for it. 0 turns it off, at start too."""

    def __post_init__(self) -> None:
        for name in ("default_wait", "max_wait", "poll_interval", "eager_interval", "max_backoff", "verify_interval"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.poll_interval <= 0 or self.eager_interval <= 0:
            raise ConfigError("poll_interval and eager_interval must be > 0")
        for name in ("drain_timeout", "read_timeout"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ConfigError(f"{name} must be None or a finite number >= 0")
        if self.connect_timeout <= 0 or self.max_request_bytes < 1:
            raise ConfigError("connect_timeout and max_request_bytes must be > 0")
        if isinstance(self.forward, str) or not all(isinstance(p, str) for p in self.forward):
            raise ConfigError("forward must be a sequence of paths")
        for path in self.forward:
            stem = path.removesuffix("/*")
            if not stem.startswith("/") or not _PLAIN_PATH.fullmatch(stem) or path in INTERNAL_PATHS:
                raise ConfigError(
                    f"forward path {path!r} must be an absolute path of plain segments (optionally "
                    "ending in /*), not one of the sidecar's own"
                )

    def forwards(self, raw_path: str) -> bool:
        """Whether a request for ``raw_path`` (as received, still percent-encoded) is relayed.

        Only plain paths match: a percent-encoded byte, an empty, ``.`` or ``..`` segment
        could mean another path to the engine than the one checked here.
        """
        if not _PLAIN_PATH.fullmatch(raw_path):
            return False
        for allowed in self.forward:
            if allowed.endswith("/*"):
                if raw_path.startswith(allowed[:-1]) and len(raw_path) > len(allowed) - 1:
                    return True
            elif raw_path == allowed:
                return True
        return False


class Sidecar:
    """Gates and relays requests to ``upstream`` while following ``subscriber``'s run.

    ``target`` is the :class:`GatedTarget` the subscriber applies versions to (give it
    so that requests pause while live weights change); without it the sidecar only
    learns of new versions when a sync returns, which suits targets that do not
    change what the engine serves (a local folder the engine is told to reload later).
    The sidecar closes ``subscriber`` when its application shuts down.
    """

    def __init__(
        self,
        subscriber: SubscriberLike,
        upstream: str,
        *,
        config: SidecarConfig | None = None,
        target: GatedTarget | None = None,
        metrics: SidecarMetrics | None = None,
        engine: str = "custom",
        run: str | None = None,
    ) -> None:
        url = URL(upstream)
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"upstream must be an http(s) URL, got {upstream!r}")
        if url.query_string or url.fragment:
            raise ConfigError("upstream must not carry a query string or fragment")
        self.upstream = url
        self.subscriber = subscriber
        self.config = config or SidecarConfig()
        self.metrics = metrics or (target.metrics if target is not None else SidecarMetrics())
        if target is not None:
            target.metrics = self.metrics
        self.target = target
        self.engine = engine
        self.run = run if run is not None else getattr(subscriber, "run", None)
        self.gate = ActivationGate(on_demand=self._on_demand)
        self.worker: SyncWorker | None = None
        self._session: aiohttp.ClientSession | None = None
        self._started = time.time()

    # -- lifecycle -------------------------------------------------------------------------

    def create_app(self) -> web.Application:
        """The aiohttp application; starting it starts the follow loop."""
        app = web.Application(client_max_size=self.config.max_request_bytes)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.connect_timeout, sock_read=self.config.read_timeout
        )
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        stop_event = threading.Event()
        bridge = GateBridge(
            self.gate,
            loop,
            self.metrics,
            drain_timeout=self.config.drain_timeout,
            stop=stop_event,
        )
        if self.target is not None:
            self.target.bridge = bridge
        self.worker = SyncWorker(
            self.subscriber,
            metrics=self.metrics,
            bridge=bridge,
            target=self.target,
            stop=stop_event,
            poll_interval=self.config.poll_interval,
            eager_interval=self.config.eager_interval,
            max_backoff=self.config.max_backoff,
            verify_interval=self.config.verify_interval,
        )
        self.gate.set_active(self.subscriber.current_version)
        self.worker.start()

    async def _stop(self, app: web.Application) -> None:
        if self.worker is not None:
            # The worker may be waiting on this loop (the gate): keep the loop turning.
            await asyncio.to_thread(self.worker.stop)
        if self._session is not None:
            await self._session.close()
        if self.target is not None:
            self.target.bridge = None
        await asyncio.to_thread(self.subscriber.close)

    # -- state -----------------------------------------------------------------------------

    def status(self) -> SyncStatus | None:
        return self.worker.status() if self.worker is not None else None

    def _on_demand(self, requirement: VersionRequirement) -> None:
        if self.worker is not None:
            self.worker.demand(requirement, self._budget(requirement))

    def _budget(self, requirement: VersionRequirement) -> float:
        asked = requirement.max_wait if requirement.max_wait is not None else self.config.default_wait
        return min(asked, self.config.max_wait)

    def _retry_after(self) -> int:
        # A client retrying sooner than our next poll could only be refused again.
        interval = self.worker.interval() if self.worker is not None else self.config.poll_interval
        return max(1, math.ceil(interval))

    def describe(self) -> dict[str, Any]:
        """What ``/version`` answers: versions, lag, readiness and the last sync error."""
        status = self.status()
        active = self.gate.active_version
        body: dict[str, Any] = {
            "run": self.run,
            "engine": self.engine,
            "current_version": active,
            "head_version": status.head if status else None,
            "lag": status.lag if status else None,
            "syncing_to": status.syncing_to if status else None,
            "activating": self.gate.activating,
            "ready": False,
            "not_ready_reason": None,
            "in_flight": self.gate.in_flight,
            "waiting": self.gate.waiting,
            "last_sync_ok": bool(status.healthy) if status else None,
            "last_error": None,
            "verifying": status.verifying if status else False,
            "last_verify": None,
            "uptime_s": round(time.time() - self._started, 3),
        }
        if status is not None and status.not_ready_code is not None:
            reason = {"code": status.not_ready_code, "message": status.not_ready_message}
        elif active is None:  # withdrawn, or before the worker's first look
            reason = {"code": "not_synced", "message": "no verified version is active"}
        else:
            reason = None
        # Ready: a verified version is served and the node follows the run; a node that a
        # permanent error stopped still serves what it holds, but is out of rotation.
        body["ready"] = active is not None and reason is None
        body["not_ready_reason"] = reason
        checked = status.last_verify if status else None
        if checked is not None:
            body["last_verify"] = {
                "version": checked.version,
                "ok": checked.ok,
                "mismatched": list(checked.mismatched),
                "seconds": round(checked.seconds, 3),
                "at": checked.checked_at,
                "repaired_to": checked.repaired_to,
                "repair_error": checked.repair_error,
            }
        if status is not None and status.last_error_code is not None:
            body["last_error"] = {
                "code": status.last_error_code,
                "message": status.last_error,
                "at": status.last_error_at,
                "consecutive_failures": status.consecutive_failures,
            }
        return body

    # -- sidecar endpoints -----------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        body = self.describe()
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response(self.describe())

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.in_flight.set(self.gate.in_flight)
        active = self.gate.active_version
        reason = self.describe()["not_ready_reason"]
        self.metrics.set_not_ready(reason["code"] if reason is not None else None)
        if active is not None:
            self.metrics.current_version.set(active)
        return web.Response(
            body=self.metrics.registry.render().encode(),
            headers={"Content-Type": CONTENT_TYPE},
        )

    # -- proxied requests ------------------------------------------------------------------

    def _error(
        self,
        status: int,
        code: str,
        message: str,
        *,
        retry_after: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> web.Response:
        info = self.describe()
        bulletin = {
            "current_version": info["current_version"],
            "head_version": info["head_version"],
            "last_error": info["last_error"],
            "not_ready_reason": info["not_ready_reason"],
            **(extra or {}),
        }
        kind = "invalid_request_error" if status in (400, 409, 410) else "server_error"
        headers = {}
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        if info["current_version"] is not None:
            headers[HEADER_SERVED] = str(info["current_version"])
        if info["head_version"] is not None:
            headers[HEADER_HEAD] = str(info["head_version"])
        return web.json_response(
            {
                "error": {"message": message, "type": kind, "param": None, "code": code},
                "bulletin": bulletin,
            },
            status=status,
            headers=headers,
        )

    def _refused(self, refusal: Refusal, requirement: VersionRequirement) -> web.Response:
        status = _REFUSAL_STATUS[refusal.reason]
        return self._error(
            status,
            _REFUSAL_CODE[refusal.reason],
            refusal.message,
            retry_after=None if refusal.reason == "gone" else self._retry_after(),
            extra={
                "required_min_version": requirement.minimum,
                "required_version": requirement.exact,
                "waited_ms": round(refusal.waited * 1000),
            },
        )

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        status = 500
        try:
            if not self.config.forwards(request.rel_url.raw_path):
                # Control endpoints (and anything else not on the allow-list) never reach
                # the engine, whatever the method or the version requirement.
                status = 404
                return self._error(
                    404,
                    "not_forwarded",
                    f"{request.rel_url.raw_path[:200]} is not relayed to the engine by this sidecar",
                )
            try:
                requirement, query = parse_requirement(request.headers, request.query)
            except InvalidInput as exc:
                status = 400
                return self._error(400, exc.code, str(exc))
            try:
                # Read the (size-capped) body before queueing: a refused upload waits for nothing.
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                status = 413
                return self._error(
                    413,
                    "request_too_large",
                    f"request body exceeds {self.config.max_request_bytes} bytes",
                )
            outcome = await self.gate.enter(requirement, self._budget(requirement))
            self.metrics.wait_seconds.observe(outcome.waited)
            if isinstance(outcome, Refusal):
                refused = self._refused(outcome, requirement)
                status = refused.status
                return refused
            response, status = await self._relay(request, query, body, outcome)
            return response
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.metrics.requests.inc(1, str(status))

    async def _relay(
        self, request: web.Request, query: MultiDict[str], body: bytes, lease: Lease
    ) -> tuple[web.StreamResponse, int]:
        self.metrics.in_flight.add(1)
        try:
            if self._session is None:
                return self._error(503, "not_ready", "the sidecar is not started"), 503
            status = self.status()
            response, outcome = await forward(
                request,
                self._session,
                self.upstream,
                query,
                body,
                lease,
                head_version=status.head if status else None,
                active_version=lambda: self.gate.active_version,
                error=lambda s, c, m: self._error(s, c, m, retry_after=self._retry_after()),
            )
            return response, outcome.status
        finally:
            self.gate.leave(lease)
            self.metrics.in_flight.add(-1)


def create_app(sidecar: Sidecar) -> web.Application:
    """The sidecar's aiohttp application (``Sidecar.create_app``)."""
    return sidecar.create_app()
