"""The activation gate: which version serves a request, and when weights may change.

It is a readers-writer lock with version waiters, confined to the sidecar's event loop:

- a request *enters* with its :class:`VersionRequirement`; it is granted a
  :class:`Lease` (a shared hold) as soon as the active version satisfies it and no
  activation is pending, and keeps the lease until its response has been sent;
- an activation (the sync worker, from its thread, through ``acquire_exclusive`` and
  ``release_exclusive``) first stops admitting requests, then waits for the leases in
  flight to end (at most ``drain_timeout``; leases still held then are marked
  *preempted*), changes the weights, and finally publishes the new version and admits,
  in the same loop callback, every waiter the new version satisfies. No other activation
  can slip in between, so a request granted "version N" is served by version N's bits
  unless it outlived a drain timeout, which its lease then says.

Refusals are ordinary return values, not exceptions: a request behind its requirement
when its wait runs out is *behind* (409, retry later), an exact version older than the
active one is *gone* (410), no verified version at all is *not_ready* (503), and a
request whose version is active but that waited out its budget behind a long
activation is *busy* (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from bulletin.errors import InvalidInput
from bulletin.sidecar.requirements import VersionRequirement

__all__ = ["ActivationGate", "Lease", "Refusal"]


@dataclass(eq=False, slots=True)
class Lease:
    """A request's shared hold on the active version."""

    version: int
    activation: int
    """The gate's activation count when granted; it differs at release if one preempted us."""
    waited: float
    """Seconds the request waited before it was admitted."""
    preempted: bool = False
    released: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not admitted; the proxy maps ``reason`` to a status code."""

    reason: Literal["behind", "gone", "not_ready", "busy"]
    current: int | None
    waited: float
    message: str


@dataclass(eq=False, slots=True)
class _Waiter:
    requirement: VersionRequirement
    future: asyncio.Future[Lease | Refusal]
    started: float = field(default_factory=time.monotonic)


class ActivationGate:
    """Shared holds for requests, exclusive holds for activations; one event loop only.

    ``on_demand`` is called (on the loop) whenever a request waits for a version newer
    than the active one, so the sync worker can fetch it now instead of at its next poll.
    """

    def __init__(self, *, on_demand: Callable[[VersionRequirement], None] | None = None) -> None:
        self._on_demand = on_demand
        self._active: int | None = None
        self._activations = 0
        self._leases: set[Lease] = set()
        self._waiters: list[_Waiter] = []
        self._writer_pending = False
        self._writer_active = False
        self._drained = asyncio.Event()
        self._drained.set()

    # -- state ---------------------------------------------------------------------------

    @property
    def active_version(self) -> int | None:
        """The version requests are being admitted to (``None`` before the first)."""
        return self._active

    @property
    def activations(self) -> int:
        """How many times the active version has changed."""
        return self._activations

    @property
    def in_flight(self) -> int:
        return len(self._leases)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def activating(self) -> bool:
        """True from the moment an activation asks for the lock until it releases it."""
        return self._writer_pending or self._writer_active

    # -- requests ------------------------------------------------------------------------

    async def enter(self, requirement: VersionRequirement, budget: float) -> Lease | Refusal:
        """Wait up to ``budget`` seconds for a version that satisfies ``requirement``."""
        started = time.monotonic()
        if requirement.unreachable_from(self._active):
            return self._gone(requirement, 0.0)
        if not self.activating and requirement.satisfied_by(self._active):
            return self._grant(started)
        if (
            self._on_demand is not None
            and requirement.wanted is not None
            and (self._active is None or requirement.wanted > self._active)
        ):
            self._on_demand(requirement)
        waiter = _Waiter(requirement, asyncio.get_running_loop().create_future(), started)
        self._waiters.append(waiter)
        try:
            await asyncio.wait({waiter.future}, timeout=max(budget, 0.0))
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()
        self._abandon(waiter)
        waited = time.monotonic() - started
        if self._active is None:
            return Refusal("not_ready", None, waited, "no verified version is active yet")
        if requirement.satisfied_by(self._active):
            return Refusal(
                "busy",
                self._active,
                waited,
                f"an activation held requests back for longer than the {waited:.3f} s allowed",
            )
        return Refusal(
            "behind",
            self._active,
            waited,
            f"version {self._active} is active; the request needs "
            + (
                f"version {requirement.exact}"
                if requirement.exact is not None
                else f"at least version {requirement.minimum}"
            )
            + f" and it was not activated within {waited:.3f} s",
        )

    def leave(self, lease: Lease) -> None:
        """End a request's hold; idempotent."""
        if lease.released:
            return
        lease.released = True
        self._leases.discard(lease)
        if not self._leases:
            self._drained.set()

    def _grant(self, started: float) -> Lease:
        if self._active is None:  # callers check satisfaction first; a version is needed
            raise InvalidInput("cannot grant a lease before a version is active")
        lease = Lease(self._active, self._activations, time.monotonic() - started)
        self._leases.add(lease)
        self._drained.clear()
        return lease

    def _gone(self, requirement: VersionRequirement, waited: float) -> Refusal:
        return Refusal(
            "gone",
            self._active,
            waited,
            f"version {requirement.exact} is no longer served: version {self._active} is "
            "active and versions only move forward",
        )

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.future.done() and not waiter.future.cancelled():
            result = waiter.future.result()
            if isinstance(result, Lease):  # granted in the same tick the wait ended
                self.leave(result)
        else:
            waiter.future.cancel()

    def _admit_waiters(self) -> None:
        keep: list[_Waiter] = []
        now = time.monotonic()
        for waiter in self._waiters:
            if waiter.future.done():
                continue
            req = waiter.requirement
            if req.unreachable_from(self._active):
                waiter.future.set_result(self._gone(req, now - waiter.started))
            elif req.satisfied_by(self._active):
                waiter.future.set_result(self._grant(waiter.started))
            else:
                keep.append(waiter)
        self._waiters = keep

    # -- activations ---------------------------------------------------------------------

    async def acquire_exclusive(self, drain_timeout: float | None) -> tuple[float, int]:
        """Stop admitting, wait for leases to end (bounded), and take the lock.

        Returns the seconds spent draining and how many leases were preempted.
        """
        if self.activating:
            raise InvalidInput("an activation is already in progress")
        self._writer_pending = True
        started = time.monotonic()
        try:
            if self._leases:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), timeout=drain_timeout)
        except BaseException:
            self._writer_pending = False
            self._admit_waiters()
            raise
        preempted = len(self._leases)
        for lease in self._leases:
            lease.preempted = True
        self._writer_pending = False
        self._writer_active = True
        return time.monotonic() - started, preempted

    def release_exclusive(self, version: int | None) -> None:
        """Release the lock; ``version`` (if given) becomes active before anyone is admitted."""
        if not self._writer_active:
            raise InvalidInput("release_exclusive without acquire_exclusive")
        self._writer_active = False
        self.set_active(version)

    def withdraw(self) -> None:
        """Serve no version until one is active again: the bits held were found damaged.

        Requests already admitted keep their leases; new ones wait (or are refused
        ``not_ready``) as on a node that holds nothing, until a repair publishes a
        verified version through :meth:`set_active` or :meth:`release_exclusive`.
        """
        self._active = None

    def set_active(self, version: int | None) -> None:
        """Record ``version`` as active (no-op for ``None``) and admit who it satisfies.

        Used directly for versions that became active without changing live weights
        (the version found on disk at start-up).
        """
        if version is not None and version != self._active:
            self._active = version
            self._activations += 1
        if not self.activating:
            self._admit_waiters()
