"""Rollout side: keep a local copy (or a live engine) at a verified version of a run.

>>> sub = Subscriber("s3://bucket/runs", "llama-grpo", "/var/lib/bulletin/llama")
>>> sub.sync()            # newest version; returns it once verified and active
>>> for version in sub.follow(interval=2.0):
...     print("serving", version)

Before it plans any route, a sync checks that the run still continues the version
held (:func:`bulletin.sync.check_chain`): a run rolled back (its newest version older
than the one held) or rewritten (the manifest of the held version gone or different)
is refused with ``RunRewound`` / ``ChainMismatch`` unless the Subscriber was made with
``allow_reset=True``, in which case it follows the new chain from a keyframe.

:meth:`Subscriber.verify` re-hashes the bits the target holds against the held
version's fingerprints; damaged bits (a flipped bit on the node's own disk) are never
patched onto: the node repairs from a keyframe route.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Self

from bulletin.errors import BulletinError, ChainMismatch, ConfigError, RunRewound, VersionNotFound
from bulletin.replica_log import Layout, open_replica
from bulletin.run import Run, StoredManifest
from bulletin.signing import TrustPolicy
from bulletin.sources import DEFAULT_LAG_GRACE, Sources
from bulletin.storage import Store, open_store
from bulletin.sync import SyncReport, check_chain, execute, plan
from bulletin.target import ArrayTarget, Held, WeightTarget

__all__ = ["Subscriber", "SubscriberStats", "VerifyReport"]

log = logging.getLogger("bulletin.subscriber")


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """One :meth:`Subscriber.verify`: the bits held, re-hashed against their version."""

    version: int | None
    """The version whose fingerprints were checked (None: nothing was held)."""
    ok: bool
    """Every tensor's bits fingerprint as the version's manifest says."""
    mismatched: tuple[str, ...]
    """Tensors whose bits do not (or that are missing or extra), sorted."""
    seconds: float
    """Time the hashing took."""
    checked_at: float
    """Wall-clock time (``time.time()``) the check finished."""
    repaired_to: int | None = None
    """The version a repair activated from a keyframe route (None: none was run or needed)."""
    repair_error_code: str | None = None
    """The error code of a repair that failed (``storage_unavailable``, ``chain_mismatch``, ...)."""
    repair_error: str | None = None
    """Its message; the node then holds nothing trusted and the next sync starts from a keyframe."""


@dataclass(slots=True)
class SubscriberStats:
    """Running totals, for metrics."""

    syncs: int = 0
    failures: int = 0
    bytes_downloaded: int = 0
    polls: int = 0
    last_report: SyncReport | None = None
    last_error: str | None = None
    verifications: int = 0
    """Calls of :meth:`Subscriber.verify` that hashed something."""
    damaged: int = 0
    """Verifications that found the bits held damaged."""
    repairs: int = 0
    """Damaged bits replaced through a keyframe route."""
    last_verify: VerifyReport | None = None
    resets: int = 0
    """Syncs that followed a rolled-back or rewritten run (``allow_reset``)."""
    last_reset: str | None = None
    """Why the last of them was needed."""


#: A store, by URL or path, or opened.
StoreLike = str | os.PathLike[str] | Store


def _as_stores(stores: StoreLike | Sequence[StoreLike]) -> list[Store]:
    """One store or several (in preference order), each opened from its URL if need be."""
    listed: Sequence[StoreLike] = [stores] if isinstance(stores, str | os.PathLike | Store) else stores
    if not listed:
        raise ConfigError("a subscriber needs at least one store")
    return [open_store(s) if isinstance(s, str | os.PathLike) else s for s in listed]


class Subscriber:
    """Follows one run of a store.

    ``local_dir`` keeps the current version as plain safetensors that survive
    restarts (a :class:`LocalDirTarget`); ``target`` instead applies versions to
    something else, such as a live engine. With neither, versions are held in host
    memory (:class:`ArrayTarget`).

    A run that no longer continues the version held (rolled back, rewritten, replaced)
    is refused with ``RunRewound`` / ``ChainMismatch``; ``allow_reset=True`` follows it
    instead, from a keyframe (the local copy may then move to an older version).

    ``trust``: take only heads and versions signed by its keys (``UntrustedVersion``
    otherwise, before anything is downloaded; docs/SECURITY.md).

    ``store`` may be a list: copies of the run (a region's mirror first, then the origin)
    read in that order, with fallback on errors and on lag (``lag_grace`` seconds; see
    :mod:`bulletin.sources`). Every manifest, from whichever store, must continue the
    chain held.

    Keyframes stream from the store to files, never into memory: a ``local_dir`` takes
    them straight into its new model folder; any other target is fed from the memory maps
    of files streamed into a temp folder under ``scratch_dir`` (the system's temp folder
    by default: give one on a disk, not a RAM-backed ``/tmp``, with room for a keyframe).

    ``layout`` is how a ``local_dir`` keeps its bits: ``dense`` (a loadable folder,
    rewritten per version) or ``log`` (:class:`~bulletin.replica_log.LogDirTarget`: a
    base folder plus a log of patches, about a patch written per version).
    """

    def __init__(
        self,
        store: StoreLike | Sequence[StoreLike],
        run: str,
        local_dir: str | os.PathLike[str] | None = None,
        *,
        target: WeightTarget | None = None,
        max_workers: int = 8,
        on_bytes: Callable[[int], None] | None = None,
        allow_reset: bool = False,
        trust: TrustPolicy | None = None,
        lag_grace: float = DEFAULT_LAG_GRACE,
        scratch_dir: str | os.PathLike[str] | None = None,
        layout: Layout = "dense",
    ) -> None:
        if local_dir is not None and target is not None:
            raise ConfigError("give either local_dir or target, not both")
        self._sources = Sources(_as_stores(store), run, max_workers=max_workers, trust=trust, lag_grace=lag_grace)
        if target is None:
            target = open_replica(Path(local_dir), run=run, layout=layout) if local_dir is not None else ArrayTarget()
        self.target: WeightTarget = target
        self._held: Held | None = target.restored()
        # The held version whose bits verify() found damaged: still what the run's chain is
        # checked against, never a base to patch (the next route starts at a keyframe).
        self._damaged: Held | None = None
        self.allow_reset = allow_reset
        self._head_version: int | None = None
        self._head_digest: str | None = None
        self._lock = threading.Lock()
        self._on_bytes = on_bytes
        self._scratch_dir = Path(scratch_dir) if scratch_dir is not None else None
        self.stats = SubscriberStats()

    @property
    def run(self) -> str:
        return self._sources.name

    @property
    def source(self) -> Run:
        """The run this subscriber reads, in its (first) store."""
        return self._sources.runs[0]

    @property
    def sources(self) -> Sources:
        """Every store this subscriber reads the run from, in preference order."""
        return self._sources

    @property
    def current_version(self) -> int | None:
        """The verified, active version (None before the first sync, and while the bits
        held are found damaged until a repair lands)."""
        held = self._held
        return held.version if held else None

    @property
    def held(self) -> Held | None:
        """The verified version held: its fingerprints and manifest digest."""
        return self._held

    def head_version(self) -> int | None:
        """The run's newest version per its head: one conditional GET, tiny when unchanged
        (with several stores, of the first one's head, the others' now and then:
        :meth:`Sources.poll`)."""
        self.stats.polls += 1
        polled = self._sources.poll()
        if polled is not None:
            self._head_version = polled.head.version
            self._head_digest = polled.head.manifest_digest
        return self._head_version

    def head_diverged(self) -> bool:
        """Whether the head last read went back from the version held, or names it with
        another manifest: a rollback or rewrite that :meth:`sync` to the tip refuses (or,
        with ``allow_reset``, follows). A head that only moved forward is not this."""
        held = self._held or self._damaged
        head = self._head_version
        if held is None or head is None:
            return False
        if head < held.version:
            return True
        digest = self._head_digest
        return head == held.version and None not in (digest, held.manifest_digest) and digest != held.manifest_digest

    def _target_manifest(self, version: int | None) -> StoredManifest:
        if version is None:
            tip = self._sources.tip()
            held = self._held or self._damaged
            if tip is None and held is not None:
                raise RunRewound(f"{self.run}: version {held.version} held here, but the run has no version left")
            if tip is None:
                raise VersionNotFound(f"{self.run}: the run has no version yet")
            return tip
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive integer, not {version!r}")
        return self._sources.read_manifest(version)

    def _activated(self, stored: StoredManifest) -> None:
        self._held = Held.at(stored)
        self._damaged = None

    def _lost(self) -> None:
        """A failed keyframe load left the target's bits unknown: report no version, and
        start the next route at a keyframe (the chain is still checked against ``held``)."""
        if self._held is not None:
            log.warning(
                "%s: a failed load may have changed the bits of version %d; it is no longer reported",
                self.run,
                self._held.version,
            )
            self._held, self._damaged = None, self._held

    def _base(self, stored: StoredManifest, *, tip: bool) -> Held | None:
        """The held version to plan from, once the run is known to still continue it.

        None (a keyframe route) for a fresh node, for damaged bits, and for a run that
        was rolled back or rewritten when ``allow_reset`` lets it be followed.
        """
        held = self._held or self._damaged
        if held is None:
            return None
        try:
            check_chain(self._sources, held, stored, tip=tip)
        except ChainMismatch as exc:
            if not self.allow_reset:
                raise
            log.warning("%s; following the run from a keyframe (allow_reset)", exc)
            self.stats.resets += 1
            self.stats.last_reset = str(exc)
            return None
        return self._held

    def _sync_locked(self, version: int | None) -> int:
        try:
            stored = self._target_manifest(version)
            base = self._base(stored, tip=version is None)
            route = plan(self._sources, stored, base)
            report = execute(
                self._sources,
                route,
                self.target,
                base,
                on_bytes=self._on_bytes,
                on_activate=self._activated,
                on_lost=self._lost,
                scratch_dir=self._scratch_dir,
            )
        except Exception as exc:
            self.stats.failures += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            raise
        self.stats.syncs += 1
        self.stats.bytes_downloaded += report.bytes_downloaded
        self.stats.last_report = report
        self.stats.last_error = None
        if version is None or self._head_version is None or stored.version > self._head_version:
            self._head_version = stored.version
            self._head_digest = stored.digest
        return stored.version

    def sync(self, version: int | None = None) -> int:
        """Bring the target to ``version`` (default: the newest) and return it.

        On failure a typed error is raised and the node keeps a verified version:
        the one it had, or a newer keyframe it reached on the way. A run that no longer
        continues the version held is ``RunRewound`` / ``ChainMismatch`` before anything
        is fetched, unless ``allow_reset``. An older ``version`` asked for explicitly on
        the same chain is reached (a chosen downgrade).
        """
        with self._lock:
            return self._sync_locked(version)

    def verify(self, *, repair: bool = True, on_damage: Callable[[], None] | None = None) -> VerifyReport:
        """Re-hash the bits the target holds and compare them with the held version's
        fingerprints (O(model); the full check, not the incremental one an apply does).

        On a mismatch the held bits are no longer trusted: a warning is logged, the node
        reports no current version, and no patch is applied onto them. With ``repair``
        the held version (or, if the run no longer has it, the newest) is then reached
        through a keyframe route, and the report says which (``repaired_to``); a repair
        that fails is in the report (``repair_error_code``, ``repair_error``), not raised,
        and the next :meth:`sync` starts from a keyframe. Without ``repair``, that next
        sync does the repair. The chain check of :meth:`sync` applies to the repair too.
        ``on_damage`` is called once damage is found, before any repair (the sidecar stops
        serving the held version there).

        The sync lock is held while hashing, so a sync waits for it; the bits only change
        under that lock, so the check never races an apply. Serving is not held up: the
        target is only read (the sidecar runs this on its follow thread).
        """
        with self._lock:
            held = self._held
            if held is None:
                return VerifyReport(None, True, (), 0.0, time.time())
            started = time.perf_counter()
            found = self.target.full_fingerprints()
            expected = held.fingerprints
            bad = tuple(sorted(n for n in expected.keys() | found.keys() if found.get(n) != expected.get(n)))
            report = VerifyReport(held.version, not bad, bad, time.perf_counter() - started, time.time())
            self.stats.verifications += 1
            self.stats.last_verify = report
            if not bad:
                return report
            self.stats.damaged += 1
            self._held, self._damaged = None, held
            log.warning(
                "%s: the bits held for version %d do not match its fingerprints (%d tensor(s): %s); %s",
                self.run,
                held.version,
                len(bad),
                ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else ""),
                "repairing from a keyframe" if repair else "the next sync starts from a keyframe",
            )
            if on_damage is not None:
                on_damage()
            if not repair:
                return report
            try:
                try:
                    self._sources.read_manifest(held.version)
                    version: int | None = held.version
                except VersionNotFound:
                    version = None  # garbage-collected: repair to the newest version instead
                reached = self._sync_locked(version)
            except BulletinError as exc:
                log.warning("%s: the repair failed (%s): %s", self.run, exc.code, exc)
                report = replace(report, repair_error_code=exc.code, repair_error=str(exc))
            else:
                self.stats.repairs += 1
                report = replace(report, repaired_to=reached)
                log.warning("%s: repaired: version %d is active again, bit-exact", self.run, reached)
            self.stats.last_verify = report
            return report

    def follow(
        self,
        *,
        interval: float = 1.0,
        stop: threading.Event | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Iterator[int]:
        """Poll the head every ``interval`` seconds and yield each newly active version.

        Failures (storage hiccups, a corrupt shard) are reported to ``on_error`` (or
        re-raised without one) and the loop goes on from the verified version it holds.
        """
        stop = stop or threading.Event()
        while not stop.is_set():
            started = time.monotonic()
            try:
                head = self.head_version()
                current = self.current_version
                if head is not None and (current is None or head > current):
                    # To the tip, not to the head's number: a head may name a version that
                    # is gone (Run.tip falls back) or lag one that is committed.
                    yield self.sync()
                elif self.head_diverged():
                    # The head went back or was rewritten: a sync to the tip refuses that
                    # (RunRewound / ChainMismatch) or, with allow_reset, follows it.
                    resets = self.stats.resets
                    reached = self.sync()
                    if reached != current or self.stats.resets != resets:
                        yield reached
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(exc)
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def close(self) -> None:
        self.target.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
