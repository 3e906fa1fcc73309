"""One run read from several stores in preference order: a region's mirror, then the origin.

:class:`Sources` is the read side of :class:`~bulletin.run.Run` (the head, manifests, the
walk down the hash chain, verified downloads) over an ordered list of stores that hold
copies of one run (:mod:`bulletin.mirror` makes them). The :class:`~bulletin.subscriber.Subscriber`
and sync planning (:mod:`bulletin.sync`) read through it; with one store it makes exactly
the requests a ``Run`` makes.

**Fallback.** A read that fails in one store with ``StorageUnavailable`` (``AccessDenied``
included), a missing object the manifest names, corrupt bytes (a digest mismatch, a bad
document) or a version its trust policy refuses is tried in the next store. A store that
failed with ``StorageUnavailable`` is tried last for ``retry_after`` seconds. A batch of
objects that fails in one store is fetched whole from the next.

**Nothing is mixed.** Every object is checked against the manifest that names it, every
manifest walked down to against its child's ``parent_digest``, and the held version
against its digest (:func:`bulletin.sync.check_chain`), whichever store answered. A later
store's newer tip is taken only if its manifest of the preferred store's tip version is
that exact manifest; a store that serves another chain is ``ChainMismatch``, never used.

**Lag, cheaply.** An idle poll reads only the first healthy store's head (one conditional
GET). The other stores' heads are read every ``lag_grace`` seconds, and whenever the first
fails. When a later store shows a version the first still lacks ``lag_grace`` seconds after
it was first seen there, the first is lagging: the head and tip are then the newest (from
the store that has it) until it catches up; a first store with no version at all is passed
over at once. A mirror that trails by less (the copy of each version in progress) is never
passed over, so a fleet keeps reading its region's mirror.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypeVar

from bulletin.errors import (
    BulletinError,
    ChainMismatch,
    ConfigError,
    CorruptData,
    HeadRolledBack,
    NotFound,
    StorageUnavailable,
    UntrustedVersion,
    VersionNotFound,
)
from bulletin.keyspace import version_of_data_key
from bulletin.run import Run, StoredHead, StoredManifest
from bulletin.storage import Store
from schemas.common import MAX_DOCUMENT_BYTES
from schemas.manifest import ObjectRef

if TYPE_CHECKING:
    from bulletin.signing import TrustPolicy

__all__ = ["DEFAULT_LAG_GRACE", "DEFAULT_RETRY_AFTER", "Reader", "Sources", "open_run"]

#: Seconds a store may trail a version another one shows before it is passed over.
DEFAULT_LAG_GRACE: Final = 30.0
#: Seconds a store that failed with ``StorageUnavailable`` is tried last.
DEFAULT_RETRY_AFTER: Final = 30.0
#: Failures after which a read is tried in the next store.
_FALLBACK: Final = (StorageUnavailable, NotFound, CorruptData, UntrustedVersion)

log = logging.getLogger("bulletin.sources")

_T = TypeVar("_T")


class Reader(Protocol):
    """What sync planning and execution read: one :class:`Run`, or :class:`Sources`."""

    @property
    def name(self) -> str: ...

    def read_manifest(
        self, version: int, *, max_bytes: int = MAX_DOCUMENT_BYTES, known_digest: str | None = None
    ) -> StoredManifest: ...

    def versions(self) -> list[int]: ...

    def ancestors(self, child: StoredManifest, *, floor: int = 1) -> Iterator[StoredManifest]: ...

    def download(self, refs: Sequence[ObjectRef], on_bytes: Callable[[int], None] | None = None) -> list[bytes]: ...

    def download_file(
        self, ref: ObjectRef, path: str | os.PathLike[str], on_bytes: Callable[[int], None] | None = None
    ) -> None: ...


def open_run(store: Store, name: str, *, max_workers: int = 8, trust: TrustPolicy | None = None) -> Run:
    """The one place a reader's :class:`Run` is made, so that every store of a node gets
    the same trust policy (whose memory of the newest head is shared between them)."""
    return Run(store, name, max_workers=max_workers, trust=trust)


@dataclass(slots=True)
class _Source:
    run: Run
    etag: str | None = None
    head: StoredHead | None = None
    known: int | None = None
    """The newest version last seen there (its head's, or its tip's)."""
    down_until: float = -math.inf


class Sources:
    """One run, read from ``stores`` in preference order (see the module's docstring).

    ``trust`` is handed to the :class:`Run` of every store. ``clock`` (monotonic seconds)
    is for tests.
    """

    def __init__(
        self,
        stores: Sequence[Store],
        run: str,
        *,
        max_workers: int = 8,
        trust: TrustPolicy | None = None,
        lag_grace: float = DEFAULT_LAG_GRACE,
        retry_after: float = DEFAULT_RETRY_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(stores, str) or not stores:
            raise ConfigError("Sources needs a non-empty list of stores")
        for label, value in (("lag_grace", lag_grace), ("retry_after", retry_after)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{label} must be a finite number of seconds >= 0, got {value!r}")
        self._sources = tuple(_Source(open_run(s, run, max_workers=max_workers, trust=trust)) for s in stores)
        self.lag_grace = float(lag_grace)
        self.retry_after = float(retry_after)
        self._clock = clock
        self._lock = threading.Lock()
        self._others_read_at: float | None = None
        # (a version some other store showed that the answering store lacked, when first seen)
        self._behind: tuple[int, float] | None = None

    @property
    def name(self) -> str:
        return self._sources[0].run.name

    @property
    def runs(self) -> tuple[Run, ...]:
        """The run in each store, in preference order."""
        return tuple(s.run for s in self._sources)

    def heads(self) -> tuple[StoredHead | None, ...]:
        """Each store's head as last read (None: not read yet, or none there), in order."""
        return tuple(s.head for s in self._sources)

    # -- order and health ---------------------------------------------------------------

    def _order(self, needs: int | None = None) -> list[int]:
        """Stores to try, best first: preference order, but those that failed lately last,
        and (for objects of version ``needs``) those known to lack that version before them."""
        now = self._clock()
        with self._lock:
            return sorted(
                range(len(self._sources)),
                key=lambda i: (
                    self._sources[i].down_until > now,
                    needs is not None and (self._sources[i].known or 0) < needs,
                    i,
                ),
            )

    def _failed(self, index: int, exc: BaseException, what: str) -> None:
        source = self._sources[index]
        if len(self._sources) > 1:
            log.warning(
                "%s: %s from %s failed (%s: %s)", self.name, what, source.run.store.url, type(exc).__name__, exc
            )
        if isinstance(exc, StorageUnavailable):
            with self._lock:
                source.down_until = self._clock() + self.retry_after

    def _raise_all_failed(self, errors: list[tuple[int, BulletinError]], what: str) -> BulletinError:
        """The error to raise when every store failed: the last store's (conventionally the
        origin's) kind, naming what each one said. With one store, its own error."""
        if len(errors) == 1:
            return errors[0][1]
        last = max(errors, key=lambda item: item[0])[1]
        said = "; ".join(f"{self._sources[i].run.store.url}: {exc.code}: {exc}" for i, exc in errors)
        combined = type(last)(f"{self.name}: {what} failed in every store ({said})")
        combined.__cause__ = last
        return combined

    def _first(self, what: str, read: Callable[[Run], _T], *, needs: int | None = None) -> _T:
        """``read`` from the first store that answers it."""
        errors: list[tuple[int, BulletinError]] = []
        for index in self._order(needs):
            try:
                return read(self._sources[index].run)
            except _FALLBACK as exc:
                errors.append((index, exc))
                self._failed(index, exc, what)
        raise self._raise_all_failed(errors, what)

    # -- heads and the tip ----------------------------------------------------------------

    def _read_head(self, index: int) -> None:
        """One conditional GET of a store's head; what it showed is remembered."""
        source = self._sources[index]
        try:
            polled = source.run.poll_head(source.etag)
        except HeadRolledBack:
            # Under a trust policy, a head older than one another store showed: that store
            # is behind (the lag rule decides), not failing; keep what it showed before.
            return
        if polled is not None:
            source.etag, source.head = polled.etag, polled
            source.known = max(source.known or 0, polled.head.version)

    def _read_others(self, answered: int) -> None:
        """The other stores' heads, for the lag rule (not those that failed lately)."""
        now = self._clock()
        for index in self._order():
            if index == answered or self._sources[index].down_until > now:
                continue
            try:
                self._read_head(index)
            except _FALLBACK as exc:
                self._failed(index, exc, "reading the head")
        with self._lock:
            self._others_read_at = self._clock()

    def _others_due(self) -> bool:
        with self._lock:
            read_at = self._others_read_at
        return len(self._sources) > 1 and (read_at is None or self._clock() - read_at >= self.lag_grace)

    def _leader(self, answered: int) -> int:
        """The store whose head and tip count: ``answered``, unless another one has shown a
        version it still lacks for ``lag_grace`` seconds (the lag rule), or it has none at
        all (a mirror not filled yet: nothing to wait for)."""
        now = self._clock()
        with self._lock:
            mine = self._sources[answered].known or 0
            ahead, newest = answered, mine
            for index, source in enumerate(self._sources):
                if (source.known or 0) > newest:
                    ahead, newest = index, source.known or 0
            if ahead == answered:
                self._behind = None
                return answered
            if not mine:
                return ahead
            if self._behind is None or self._behind[0] <= mine:
                self._behind = (newest, now)  # (re)start the clock on the version it lacks
            if now - self._behind[1] >= self.lag_grace:
                return ahead
            return answered

    def _answering(self, what: str, read: Callable[[int], None]) -> int:
        """Run ``read`` on the first store that answers; then, when due (or when a store
        failed), read the others' heads for the lag rule. Returns the store that answered."""
        errors: list[tuple[int, BulletinError]] = []
        for index in self._order():
            try:
                read(index)
            except _FALLBACK as exc:
                errors.append((index, exc))
                self._failed(index, exc, what)
                continue
            if errors or self._others_due():
                self._read_others(index)
            return index
        raise self._raise_all_failed(errors, what)

    def poll(self) -> StoredHead | None:
        """The head that counts (None: no store has one yet), as cheaply as the lag rule
        allows: one conditional GET of the first healthy store's head (a small ``304`` when
        unchanged), plus one of each other store's every ``lag_grace`` seconds."""
        answered = self._answering("reading the head", self._read_head)
        return self._sources[self._leader(answered)].head

    def tip(self) -> StoredManifest | None:
        """The newest committed version (:meth:`Run.tip`) of the first store that answers,
        or of a later store it lags (the lag rule), once that store's manifest of the
        first's tip version is found to be the same manifest (``ChainMismatch`` if not)."""
        tips: dict[int, StoredManifest | None] = {}

        def read(index: int) -> None:
            tip = self._sources[index].run.tip()
            tips[index] = tip
            if tip is not None:
                self._sources[index].known = max(self._sources[index].known or 0, tip.version)

        answered = self._answering("finding the tip", read)
        best = tips[answered]
        leader = self._leader(answered)
        if leader == answered:
            return best
        try:
            newer = self._sources[leader].run.tip()
        except _FALLBACK as exc:
            self._failed(leader, exc, "finding the tip")
            return best
        if newer is None or (best is not None and newer.version <= best.version):
            return best
        if best is not None:
            self._check_same_chain(leader, answered, best)
        log.info(
            "%s: %s lags (version %s); taking version %d from %s",
            self.name,
            self._sources[answered].run.store.url,
            best.version if best else "none",
            newer.version,
            self._sources[leader].run.store.url,
        )
        return newer

    def _check_same_chain(self, leader: int, answered: int, theirs: StoredManifest) -> None:
        """``ChainMismatch`` unless store ``leader`` holds the manifest ``theirs`` (store
        ``answered``'s) at its version: two stores are copies of one run only if they agree."""
        ours = self._sources[leader].run
        try:
            same = ours.read_manifest(theirs.version)
        except VersionNotFound:
            log.warning(
                "%s: %s no longer has version %d to compare with %s's; taking its chain unchecked",
                self.name,
                ours.store.url,
                theirs.version,
                self._sources[answered].run.store.url,
            )
            return
        if same.digest != theirs.digest:
            raise ChainMismatch(
                f"{self.name}: {ours.store.url} and {self._sources[answered].run.store.url} serve different "
                f"chains (their manifests of version {theirs.version} are {same.digest[:16]}... and "
                f"{theirs.digest[:16]}...): they are not copies of one run; fix or remove one"
            )

    # -- manifests and objects ------------------------------------------------------------

    def read_manifest(
        self, version: int, *, max_bytes: int = MAX_DOCUMENT_BYTES, known_digest: str | None = None
    ) -> StoredManifest:
        """The manifest of ``version`` from the first store that has it (``VersionNotFound``
        if none does); ``known_digest`` as for :meth:`Run.read_manifest`."""
        return self._first(
            f"reading version {version}",
            lambda run: run.read_manifest(version, max_bytes=max_bytes, known_digest=known_digest),
        )

    def versions(self) -> list[int]:
        """Every version some store holds, ascending (one listing per store that answers)."""
        found: set[int] = set()
        errors: list[tuple[int, BulletinError]] = []
        for index in self._order():
            try:
                found.update(self._sources[index].run.versions())
            except _FALLBACK as exc:
                errors.append((index, exc))
                self._failed(index, exc, "listing the versions")
        if len(errors) == len(self._sources):
            raise self._raise_all_failed(errors, "listing the versions")
        return sorted(found)

    def ancestors(self, child: StoredManifest, *, floor: int = 1) -> Iterator[StoredManifest]:
        """:meth:`Run.ancestors` of ``child``, walked (and read ahead) in the first store; a
        version the walking store lacks or fails is read from the next store that has it,
        checked against its child's ``parent_digest`` like every other, and that store walks
        on. The walk ends where no store has the next version (garbage-collected)."""
        order = self._order()
        walker = order[0]
        while child.manifest.patch is not None and child.version - 1 >= floor:
            errors: list[tuple[int, BulletinError]] = []
            try:
                for stored in self._sources[walker].run.ancestors(child, floor=floor):
                    yield stored
                    child = stored
            except _FALLBACK as exc:
                errors.append((walker, exc))
                self._failed(walker, exc, f"reading the version below {child.version}")
            if child.manifest.patch is None or child.version - 1 < floor:
                return
            parent = None
            for index in order:
                if index == walker:
                    continue
                try:  # floor = the parent's version: exactly the parent, checked
                    parent = next(self._sources[index].run.ancestors(child, floor=child.version - 1), None)
                except _FALLBACK as exc:
                    errors.append((index, exc))
                    self._failed(index, exc, f"reading version {child.version - 1}")
                    continue
                if parent is not None:
                    walker = index
                    break
            if parent is None:
                if errors:
                    raise self._raise_all_failed(errors, f"reading version {child.version - 1}")
                return  # no store has it (garbage-collected): the walk ends, as in one store
            yield parent
            child = parent

    def download(self, refs: Sequence[ObjectRef], on_bytes: Callable[[int], None] | None = None) -> list[bytes]:
        """:meth:`Run.download` from the first store that serves every object intact;
        stores known to lack the objects' version are tried after the others."""
        versions = [v for v in (version_of_data_key(ref.key) for ref in refs) if v is not None]
        return self._first(
            f"downloading {len(refs)} object(s)",
            lambda run: run.download(refs, on_bytes),
            needs=max(versions) if versions else None,
        )

    def download_file(
        self, ref: ObjectRef, path: str | os.PathLike[str], on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """:meth:`Run.download_file` from the first store that serves the object intact."""
        self._first(
            f"downloading {ref.key}",
            lambda run: run.download_file(ref, path, on_bytes),
            needs=version_of_data_key(ref.key),
        )
