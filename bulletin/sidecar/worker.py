"""The sidecar's background follow loop, and the target wrapper that pauses requests.

:class:`SyncWorker` owns the Subscriber: every call into it happens on the worker's
thread. It polls the head (a conditional GET) every ``poll_interval`` seconds, or every
``eager_interval`` while a request is waiting for a version newer than the active
one, and syncs to the head, or first to the lowest exact version a request is
waiting for. Failures are recorded (metrics, ``/version``, ``/readyz``) and retried
with exponential backoff; the last verified version keeps serving. A head that went
back (or names the held version with another manifest) makes it sync to the run's tip,
which the Subscriber refuses (``RunRewound`` / ``ChainMismatch``, recorded as a
failure) unless it was made with ``allow_reset``.

Every ``verify_interval`` seconds, and once before the first poll, the worker re-hashes
the bits held (:meth:`bulletin.subscriber.Subscriber.verify`) on its own thread: requests
are served meanwhile, syncs wait. Damaged bits are rebuilt from a keyframe route at
once; the result is in the metrics and in ``/version`` (``last_verify``).

Two failures take the node out of service (``/readyz`` 503 with a reason, the gate
serving nothing or the version it holds, ``bulletin_not_ready{code}``):

- a failed sync after the engine's weights may have been touched (a load, apply or
  activation had begun: :attr:`GatedTarget.touched`) withdraws the version at once and
  re-hashes what the engine holds (a verification): the version comes back only if the
  engine demonstrably holds it, damaged bits are rebuilt from a keyframe, and a check
  that cannot run is retried with backoff while nothing is served (``engine_unverified``);
- a permanent incompatibility (the engine cannot hold the run's tensors:
  ``IncompatibleTensors``, ``UnsupportedDtype``) stops the follow loop: one error in the
  log, on ``/readyz`` and in the metrics, and no more downloads until a restart.

:class:`GatedTarget` wraps the engine's :class:`~bulletin.target.WeightTarget`. While
the live weights change (``load_full`` / ``apply`` of an in-place target, ``activate``
of any target) it holds the activation gate exclusively, so new requests wait and the
ones in flight finish first; ``activate`` publishes the new version to the gate before
it lets anyone in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from bulletin.errors import (
    BulletinError,
    EngineError,
    IncompatibleTensors,
    UnsupportedDtype,
    VerificationFailed,
    WrongBase,
)
from bulletin.sidecar.gate import ActivationGate
from bulletin.sidecar.metrics import SidecarMetrics
from bulletin.sidecar.requirements import VersionRequirement
from bulletin.target import Held, WeightTarget

if TYPE_CHECKING:
    from pathlib import Path

    from bulletin.subscriber import VerifyReport
    from bulletin.target import FetchFiles, WriteKeyframe
    from patcher.context_decode import CodedChanges
    from patcher.format import TensorInfo
    from patcher.patch import Patch, TensorSpec
    from schemas.manifest import FileRef

__all__ = ["PERMANENT_ERRORS", "GateBridge", "GatedTarget", "SubscriberLike", "SyncStatus", "SyncWorker"]

#: Errors that no retry can fix (the engine cannot hold the run's tensors): the worker stops.
PERMANENT_ERRORS: tuple[type[BulletinError], ...] = (IncompatibleTensors, UnsupportedDtype)
#: Not-ready reasons that are not error codes.
NOT_SYNCED = "not_synced"
ENGINE_UNVERIFIED = "engine_unverified"

log = logging.getLogger("bulletin.sidecar")

Bits = NDArray[np.unsignedinteger]
_T = TypeVar("_T")


class SubscriberLike(Protocol):
    """What the worker uses of :class:`bulletin.subscriber.Subscriber`."""

    @property
    def current_version(self) -> int | None: ...

    def head_version(self) -> int | None: ...

    def head_diverged(self) -> bool: ...

    def sync(self, version: int | None = None) -> int: ...

    def verify(self, *, repair: bool = True, on_damage: Callable[[], None] | None = None) -> VerifyReport: ...

    def close(self) -> None: ...


class GateBridge:
    """Takes and releases the gate (which lives on the event loop) from the worker thread."""

    def __init__(
        self,
        gate: ActivationGate,
        loop: asyncio.AbstractEventLoop,
        metrics: SidecarMetrics,
        *,
        drain_timeout: float | None,
        stop: threading.Event,
    ) -> None:
        self.gate = gate
        self.loop = loop
        self.metrics = metrics
        self.drain_timeout = drain_timeout
        self._stop = stop
        self._held_since: float | None = None

    def _wait(self, future: Future[_T]) -> _T:
        # Poll so that a stopping sidecar never leaves this thread blocked for ever.
        while True:
            try:
                return future.result(timeout=0.25)
            except TimeoutError:
                if self._stop.is_set() or self.loop.is_closed():
                    future.cancel()
                    raise EngineError("the sidecar is stopping; the engine keeps its version") from None

    def acquire(self) -> int:
        """Block until the gate is held exclusively (idempotent while held); returns how
        many requests were still in flight when the drain timeout ended the wait."""
        if self._held_since is not None:
            return 0
        future = asyncio.run_coroutine_threadsafe(self.gate.acquire_exclusive(self.drain_timeout), self.loop)
        drained, preempted = self._wait(future)
        self._held_since = time.monotonic()
        self.metrics.drain_seconds.observe(drained)
        if preempted:
            self.metrics.preempted.inc(preempted)
            log.warning("activation went ahead with %d requests still in flight", preempted)
        return preempted

    def release(self, version: int | None) -> None:
        """Release the gate, publishing ``version`` as active first (None: unchanged)."""
        if self._held_since is None:
            if version is not None:
                self.set_active(version)
            return
        paused = time.monotonic() - self._held_since
        self._held_since = None
        self.metrics.pause_seconds.observe(paused)
        self._call(self.gate.release_exclusive, version)

    def set_active(self, version: int | None) -> None:
        self._call(self.gate.set_active, version)

    def withdraw(self) -> None:
        """Stop serving the version held (its bits were found damaged); waits for the loop."""
        self._call(lambda _: self.gate.withdraw(), None)

    def _call(self, fn: Callable[[int | None], None], version: int | None) -> None:
        """Run ``fn(version)`` on the loop and wait for it; never raises (it runs in
        ``finally`` blocks, including while the sidecar stops)."""

        async def run() -> None:
            fn(version)

        if self.loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30.0)
        except (TimeoutError, RuntimeError) as exc:  # a loop that stopped under us
            log.warning("could not update the activation gate: %r", exc)


class GatedTarget(WeightTarget):
    """A WeightTarget that holds the activation gate while the engine's weights change.

    For targets whose :attr:`~bulletin.target.WeightTarget.in_place` is true (the torch
    and vLLM targets, and any that do not say otherwise) ``load_full`` and the applies
    pause requests too; for the others (SGLang, a local folder an engine reloads from)
    only ``activate`` does. ``in_place`` given here overrides the inner target's.
    ``on_preempt`` is called (on the sync thread, before any weight changes) when the
    drain timeout let an activation go ahead with requests still in flight: an engine
    this process runs ends their generations there (``CompletionServer.preempt``).
    """

    def __init__(
        self,
        inner: WeightTarget,
        metrics: SidecarMetrics | None = None,
        *,
        in_place: bool | None = None,
        on_preempt: Callable[[], None] | None = None,
    ) -> None:
        self.inner = inner
        self.in_place = inner.in_place if in_place is None else in_place
        self.restores_loads = inner.restores_loads
        self.stages_keyframes = inner.stages_keyframes
        self.metrics = metrics or SidecarMetrics()
        self.bridge: GateBridge | None = None
        self.on_preempt = on_preempt
        self._loaded = False  # a load_full since the last activation
        #: An engine-side change began (a load or apply of an in-place target, any
        #: activation) and has not been activated: if the sync fails, what the engine holds
        #: must be verified before its version is served again.
        self.touched = False

    def _hold(self) -> None:
        if self.bridge is not None and self.bridge.acquire() and self.on_preempt is not None:
            self.on_preempt()

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.inner.layout()

    @property
    def supports_shards(self) -> bool:
        return self.inner.supports_shards

    def restored(self) -> Held | None:
        return self.inner.restored()

    def context_bits(self) -> Mapping[str, Bits] | None:
        return self.inner.context_bits()  # only read: no pause needed

    @property
    def resolves_context(self) -> bool:
        return self.inner.resolves_context

    def resolve_context(
        self,
        changes: Sequence[CodedChanges],
        tensors: Mapping[str, TensorInfo],
        fingerprints: Mapping[str, int],
        *,
        pending: Patch | None = None,
    ) -> Patch:
        return self.inner.resolve_context(changes, tensors, fingerprints, pending=pending)  # only reads

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        if self.in_place:
            self._hold()
            self.touched = True
        started = time.perf_counter()
        self._loaded = True
        self.inner.load_full(tensors, specs)
        self.metrics.apply_seconds.observe(time.perf_counter() - started)

    def load_keyframe(
        self, write: WriteKeyframe, fingerprints: Mapping[str, int], *, scratch_dir: Path | None = None
    ) -> None:
        if self.in_place and not self.inner.stages_keyframes:
            # Never download under the gate: the default streams to scratch files, then
            # load_full above holds it for the load alone.
            super().load_keyframe(write, fingerprints, scratch_dir=scratch_dir)
            return
        self._loaded = True
        self.inner.load_keyframe(write, fingerprints, scratch_dir=scratch_dir)  # nothing served changes yet

    def prepare(self, patch: Patch, fingerprints: Mapping[str, int]) -> None:
        self.inner.prepare(patch, fingerprints)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        if self.in_place:
            # Targets that can check and precompute an apply by reading only do it while
            # requests still run, so that the pause below is the writes alone.
            try:
                self.inner.prepare(patch, fingerprints)
            except (WrongBase, VerificationFailed):
                # The engine's bits are not the base the record says it holds (an engine
                # that checks its own, as vLLM's workers do): what it serves is in doubt.
                self.touched = True
                raise
            self._hold()
            self.touched = True
        started = time.perf_counter()
        result = self.inner.apply(patch, fingerprints)
        self.metrics.apply_seconds.observe(time.perf_counter() - started)
        return result

    def apply_shards(self, shards: Sequence[bytes], fingerprints: Mapping[str, int]) -> dict[str, int]:
        if self.in_place:
            self._hold()  # decoding and writing are one pass: nothing to do before the pause
            self.touched = True
        started = time.perf_counter()
        result = self.inner.apply_shards(shards, fingerprints)
        self.metrics.apply_seconds.observe(time.perf_counter() - started)
        return result

    def stage_files(self, files: Sequence[FileRef], fetch: FetchFiles) -> None:
        self.inner.stage_files(files, fetch)  # files on disk: nothing the engine serves changes

    def abort(self) -> None:
        self.inner.abort()
        if self._loaded and not self.restores_loads and self.bridge is not None:
            # The engine may hold the new bits, the old or a mix: serve nothing until a
            # verified version is activated again.
            self.bridge.withdraw()
        self._loaded = False

    def full_fingerprints(self) -> dict[str, int]:
        return self.inner.full_fingerprints()

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        self._hold()
        self.touched = True
        self.inner.activate(version, manifest_digest=manifest_digest)
        self._loaded = False
        self.touched = False
        if self.bridge is not None:
            self.bridge.release(version)

    def finish(self) -> None:
        """Release the gate if a failed sync left it held (the old version stays)."""
        if self.bridge is not None:
            self.bridge.release(None)

    def close(self) -> None:
        self.inner.close()


@dataclass(frozen=True, slots=True)
class SyncStatus:
    """A snapshot of the worker's state, safe to read from any thread."""

    current: int | None
    head: int | None
    syncing_to: int | None
    last_error_code: str | None
    last_error: str | None
    last_error_at: float | None
    consecutive_failures: int
    last_verify: VerifyReport | None = None
    """The last verification that hashed something (None before the first)."""
    verifying: bool = False
    """A verification is re-hashing the bits held now."""
    not_ready_code: str | None = None
    """Why no version is served or the node is out of service (``not_synced``,
    ``engine_unverified``, or the code of a permanent error), None while ready."""
    not_ready_message: str | None = None
    halted: bool = False
    """A permanent error stopped the follow loop (until a restart)."""

    @property
    def lag(self) -> int | None:
        if self.head is None:
            return None
        return max(0, self.head - (self.current or 0))

    @property
    def healthy(self) -> bool:
        return self.consecutive_failures == 0


class SyncWorker:
    """Runs the follow loop on its own thread; see the module docstring."""

    def __init__(
        self,
        subscriber: SubscriberLike,
        *,
        metrics: SidecarMetrics,
        bridge: GateBridge | None = None,
        target: GatedTarget | None = None,
        stop: threading.Event | None = None,
        poll_interval: float = 1.0,
        eager_interval: float = 0.05,
        max_backoff: float = 30.0,
        verify_interval: float = 0.0,
    ) -> None:
        self.subscriber = subscriber
        self.metrics = metrics
        self.bridge = bridge
        self.target = target
        self.poll_interval = poll_interval
        self.eager_interval = eager_interval
        self.max_backoff = max_backoff
        #: Seconds between verifications of the bits held (0: never, not even at start).
        self.verify_interval = verify_interval
        self.stop_event = stop or threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._exact_wanted: set[int] = set()
        self._eager_until = 0.0
        self._head: int | None = None
        self._syncing_to: int | None = None
        self._error: tuple[str, str, float] | None = None
        self._failures = 0
        self._last_verify: VerifyReport | None = None
        self._verifying = False
        #: (code, message) of a permanent error that stopped the loop.
        self._halted: tuple[str, str] | None = None
        #: Why the engine's bits must be verified before its version is served again.
        self._unverified: str | None = None
        self._thread: threading.Thread | None = None

    # -- control ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="bulletin-sidecar-sync", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("sync worker did not stop within %.0f s", timeout)
            self._thread = None

    def demand(self, requirement: VersionRequirement, budget: float) -> None:
        """A request waits for a newer version: poll eagerly for ``budget`` seconds."""
        with self._lock:
            if requirement.exact is not None:
                self._exact_wanted.add(requirement.exact)
            self._eager_until = max(self._eager_until, time.monotonic() + budget)
        self._wake.set()

    def status(self) -> SyncStatus:
        with self._lock:
            error = self._error
            reason = self._not_ready_locked()
            return SyncStatus(
                current=self.subscriber.current_version,
                head=self._head,
                syncing_to=self._syncing_to,
                last_error_code=error[0] if error else None,
                last_error=error[1] if error else None,
                last_error_at=error[2] if error else None,
                consecutive_failures=self._failures,
                last_verify=self._last_verify,
                verifying=self._verifying,
                not_ready_code=reason[0] if reason else None,
                not_ready_message=reason[1] if reason else None,
                halted=self._halted is not None,
            )

    def _not_ready_locked(self) -> tuple[str, str] | None:
        """(code, message) of why the node is not ready, or None (under ``_lock``)."""
        if self._halted is not None:
            return self._halted
        if self._unverified is not None:
            return ENGINE_UNVERIFIED, self._unverified
        if self.subscriber.current_version is None:
            return NOT_SYNCED, "no verified version is held yet"
        return None

    # -- the loop --------------------------------------------------------------------------

    def interval(self) -> float:
        """Seconds until the next poll: backoff after failures, short while requests wait."""
        with self._lock:
            failures = self._failures
            eager = time.monotonic() < self._eager_until
        if failures:
            return min(self.max_backoff, self.poll_interval * float(2 ** min(failures - 1, 16)))
        return self.eager_interval if eager else self.poll_interval

    def _run(self) -> None:
        next_due = time.monotonic()
        # The first verification comes before the first poll: no patch lands on bad bits.
        next_verify = time.monotonic() if self.verify_interval > 0 else math.inf
        while not self.stop_event.is_set():
            now = time.monotonic()
            if self._halted is not None:
                # Nothing a retry can fix: no polls, no downloads until a restart.
                self._wake.wait(self.poll_interval)
                self._wake.clear()
                continue
            if self._unverified is not None:
                self.verify_step()
                if self._unverified is not None:  # the check could not run: back off
                    self._wake.wait(self.interval())
                    self._wake.clear()
                next_due = time.monotonic()
                continue
            if now >= next_verify:
                self.verify_step()
                next_verify = time.monotonic() + self.verify_interval
                continue
            if now < next_due:
                woken = self._wake.wait(min(next_due, next_verify) - now)
                self._wake.clear()
                if self.stop_event.is_set():
                    break
                if not woken:
                    continue  # a poll or a verification is due: look again
                with self._lock:
                    failing = self._failures > 0
                # A demand wakes us early unless we are backing off after failures.
                if failing and time.monotonic() < next_due:
                    continue
            self.step()
            next_due = time.monotonic() + self.interval()

    def verify_step(self) -> VerifyReport | None:
        """One verification of the bits held, repaired from a keyframe if damaged; never raises."""
        with self._lock:
            self._verifying = True
        report: VerifyReport | None = None
        unverified = self._unverified
        try:
            # Damaged bits are never served: the gate withdraws the version before the
            # repair starts, and the repair's activation publishes the verified one.
            report = self.subscriber.verify(on_damage=self.bridge.withdraw if self.bridge is not None else None)
        except Exception as exc:  # the target could not be read (an engine down, a bug)
            self.metrics.verifications.inc(1, "failed")
            if isinstance(exc, BulletinError):
                log.warning("verification failed (%s): %s", exc.code, exc)
            else:
                log.exception("verification failed unexpectedly")
            if unverified is not None:  # still nothing served: say why, and back off
                code = exc.code if isinstance(exc, BulletinError) else "internal_error"
                self._record_failure(code, f"verifying the engine after a failed change: {exc}")
            return None
        finally:
            with self._lock:
                self._verifying = False
                if report is not None and report.version is not None:
                    self._last_verify = report
                if report is not None and unverified is not None:
                    # Verified as held (ok), or the damage was found and handled as such.
                    self._unverified = None
            self._settle(self._head)
        if report.version is None:
            return report  # nothing held yet: nothing was hashed
        self.metrics.verify_seconds.observe(report.seconds)
        self.metrics.verifications.inc(1, "ok" if report.ok else "damaged")
        if report.repaired_to is not None:
            self.metrics.repairs.inc()
        if report.repair_error_code is not None:
            self._record_failure(report.repair_error_code, f"repair of damaged bits: {report.repair_error}")
        elif not report.ok:
            self._succeeded()
        return report

    def step(self) -> None:
        """One poll, and a sync if the head moved; never raises."""
        try:
            head = self.subscriber.head_version()
        except BulletinError as exc:
            self._failed(exc, during="poll")
            return
        except Exception as exc:  # a bug or an unexpected library error: keep serving
            log.exception("head poll failed unexpectedly")
            self._failed(exc, during="poll")
            return
        with self._lock:
            self._head = head
        current = self.subscriber.current_version
        target = self._choose(head, current)
        self._publish_gauges(head, current)
        # The head went back, or names the held version with another manifest: sync to the
        # tip, which refuses a rolled-back or rewritten run unless allow_reset follows it.
        to_tip = target is None and self.subscriber.head_diverged()
        if target is None and not to_tip:
            self._succeeded()
            return
        during = f"sync to version {target}" if target is not None else f"sync to the run's tip (head {head})"
        with self._lock:
            self._syncing_to = target if target is not None else head
        started = time.perf_counter()
        try:
            # Chasing the head means the tip (a head may name a version that is gone, or lag
            # one committed); a version a request asked for exactly is synced to by number.
            reached = self.subscriber.sync(None if target == head else target)
        except BulletinError as exc:
            self._failed(exc, during=during)
            self._after_failure(exc, during)
        except Exception as exc:
            log.exception("%s failed unexpectedly", during)
            self._failed(exc, during=during)
            self._after_failure(exc, during)
        else:
            self._succeeded()
            if not to_tip or reached != current:
                self.metrics.syncs.inc()
                self.metrics.sync_seconds.observe(time.perf_counter() - started)
                log.info("version %s active", self.subscriber.current_version)
        finally:
            with self._lock:
                self._syncing_to = None
            self._settle(head)

    def _after_failure(self, exc: Exception, during: str) -> None:
        """Take the node out of service where a failure left it unable to vouch for the
        engine (see the module docstring)."""
        if isinstance(exc, PERMANENT_ERRORS):
            message = f"{during}: {exc}"
            with self._lock:
                self._halted = (exc.code, message)
            log.error(
                "the engine cannot hold this run's tensors (%s): %s; the sidecar stops following the "
                "run until it is restarted",
                exc.code,
                message,
            )
            return
        if self.target is not None and self.target.touched:
            self.target.touched = False
            with self._lock:
                self._unverified = f"{during} failed after the engine's weights may have changed: {exc}"
            log.warning("%s; serving nothing until the engine is verified", self._unverified)
            if self.bridge is not None:
                self.bridge.withdraw()

    def _settle(self, head: int | None) -> None:
        """After anything that may have changed the target: release the gate if a failure
        left it held, and tell it (and the gauges) which verified version is live."""
        if self.target is not None:
            self.target.finish()
        # Targets without a gate wrapper (or a keyframe activated before a failure)
        # still have to tell the gate which verified version is live, unless what the
        # engine holds is in doubt.
        with self._lock:
            doubt = self._unverified is not None
        if self.bridge is not None and not doubt:
            self.bridge.set_active(self.subscriber.current_version)
        self._publish_gauges(head, self.subscriber.current_version)
        self._publish_readiness()

    def _publish_readiness(self) -> None:
        with self._lock:
            reason = self._not_ready_locked()
        self.metrics.set_not_ready(reason[0] if reason else None)

    def _choose(self, head: int | None, current: int | None) -> int | None:
        if head is None or (current is not None and head <= current):
            return None
        with self._lock:
            floor = current or 0
            self._exact_wanted = {v for v in self._exact_wanted if v > floor}
            exact = [v for v in self._exact_wanted if v <= head]
        # Stop at a version a request asked for exactly before moving on to the head.
        return min(exact) if exact else head

    def _publish_gauges(self, head: int | None, current: int | None) -> None:
        m = self.metrics
        if head is not None:
            m.head_version.set(head)
        if current is not None:
            m.current_version.set(current)
        if head is not None and current is not None:
            m.version_lag.set(max(0, head - current))
        elif head is not None:
            m.version_lag.set(head)

    def _succeeded(self) -> None:
        with self._lock:
            self._failures = 0
        self.metrics.last_sync_ok.set(1)

    def _failed(self, exc: Exception, *, during: str) -> None:
        code = exc.code if isinstance(exc, BulletinError) else "internal_error"
        self._record_failure(code, f"{during}: {exc}")

    def _record_failure(self, code: str, message: str) -> None:
        with self._lock:
            self._failures += 1
            self._error = (code, message, time.time())
        self.metrics.sync_failures.inc(1, code)
        self.metrics.last_sync_ok.set(0)
        log.warning("failed (%s): %s", code, message)
