"""Mirrors: one run replicated into another store, with the origin's guarantees.

>>> mirror = Mirror("s3://origin/runs", "s3://eu-mirror/runs", "llama-grpo", keep=50)
>>> mirror.sync()                      # copy what is new, once; returns a MirrorReport
>>> for report in mirror.follow(interval=2.0):
...     print("mirrored", report.to_version)

A mirror copies verbatim and never writes a document of its own: every patch shard,
keyframe file and model file byte for byte, then the manifest's detached signature when there is one,
then the manifest itself, create-only, in version order; after the last version, the
origin's head bytes (a signed head included, which the mirror could not sign again),
moved by compare-and-swap and only forward. Before a manifest is created every object
it names is in the mirror and checked against the size and SHA-256 it promises, and it
continues the hash chain the mirror holds, so **a mirror never shows a version whose
objects are not all there**, and a subscriber reading it (:mod:`bulletin.sources`)
checks everything as it would at the origin.

Resuming is the same call: the mirror's state is the mirror's store (its newest manifest),
so a copy killed at any point goes on from there. Objects already present are checked
(size, then SHA-256), never trusted blindly; one with other bytes is ``CorruptData`` and
is not overwritten. A mirror refuses to follow an origin that was rolled back
(``RunRewound``) or rewritten (``ChainMismatch``): recreate it. With ``keep=N`` it keeps
the newest N versions and the keyframe they start from (:func:`bulletin.maintenance.collect_garbage`
on the mirror after each copy), and a mirror started empty, or too far behind, copies
only what those versions need. The origin is only read: read access is all a mirror
needs there (the README's least-privilege S3 policies; docs/MIRRORS.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

from bulletin import keyspace
from bulletin.errors import (
    ChainMismatch,
    ConfigError,
    CorruptData,
    FormatError,
    NotFound,
    ObjectTooLarge,
    RunRewound,
    VersionNotFound,
)
from bulletin.maintenance import collect_garbage
from bulletin.run import Run, StoredManifest, sha256_hex
from bulletin.sources import open_run
from bulletin.storage import Conflicted, ObjectData, Store, Updated, open_store, require_writable
from schemas.common import MAX_DOCUMENT_BYTES
from schemas.head import parse_head
from schemas.manifest import Manifest, ObjectRef, manifest_files, parse_manifest

if TYPE_CHECKING:
    from bulletin.signing import TrustPolicy

__all__ = ["Mirror", "MirrorReport"]

log = logging.getLogger("bulletin.mirror")

#: Compare-and-swap attempts on the mirror's head before giving up (another writer moving it).
_HEAD_ATTEMPTS: Final = 100


@dataclass(slots=True)
class MirrorReport:
    """What one :meth:`Mirror.sync` did, for logs and the CLI's ``--json``."""

    run: str
    origin: str
    destination: str
    from_version: int | None = None
    """The mirror's newest version before (None: it was empty)."""
    to_version: int | None = None
    """Its newest version after."""
    head_version: int | None = None
    """The version the mirror's head names after (None: no head yet)."""
    versions: list[int] = field(default_factory=list)
    """Versions whose manifest this call created, ascending."""
    objects_copied: int = 0
    bytes_copied: int = 0
    objects_checked: int = 0
    """Objects found already in the mirror (a resumed copy) and checked, not copied."""
    pruned_versions: int = 0
    """Manifests ``keep`` removed from the mirror."""
    pruned_objects: int = 0
    stopped: bool = False
    """The copy was asked to stop between two versions before it reached the origin's newest."""
    seconds: float = 0.0


def _store(store: str | os.PathLike[str] | Store) -> Store:
    return open_store(store) if isinstance(store, str | os.PathLike) else store


def _object_refs(manifest: Manifest) -> list[ObjectRef]:
    """Every data object the manifest names: its patch shards, keyframe files and model
    files (of any manifest version a reader understands: ``Manifest`` is their union).
    A model file named by several versions is one object, listed once per manifest."""
    refs = list(manifest.patch.shards) if manifest.patch is not None else []
    if manifest.keyframe is not None:
        refs.extend(manifest.keyframe.files)
    seen = {ref.key for ref in refs}
    for ref in manifest_files(manifest):
        if ref.key not in seen:
            seen.add(ref.key)
            refs.append(ref)
    return refs


class Mirror:
    """Replicates run ``run`` from ``origin`` into ``destination`` (see the module docstring).

    ``keep``: keep only the newest ``keep`` versions (and the keyframe they start from) in
    the mirror. ``trust``: copy only heads and versions it accepts (the origin's heads and
    every manifest, checked as read); the mirror's own copies are then checked against
    those bytes. ``grace``: how old an object no kept manifest names must be before
    ``keep`` removes it (a copy in flight is never touched).
    """

    def __init__(
        self,
        origin: str | os.PathLike[str] | Store,
        destination: str | os.PathLike[str] | Store,
        run: str,
        *,
        keep: int | None = None,
        max_workers: int = 8,
        trust: TrustPolicy | None = None,
        grace: timedelta = timedelta(hours=1),
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"keep must be a positive number of versions, got {keep!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ConfigError(f"max_workers must be a positive int, got {max_workers!r}")
        source, target = _store(origin), _store(destination)
        if source.url == target.url:
            raise ConfigError(f"a mirror needs two stores; both are {source.url}")
        require_writable(target, "mirroring into it")  # the origin is only read: any store will do
        self.origin: Run = open_run(source, run, max_workers=max_workers, trust=trust)
        # The mirror's side is judged against the origin's bytes, not by the policy: its
        # head may trail one the policy has already seen at the origin.
        self.destination: Run = Run(target, run, max_workers=max_workers)
        self.trust = trust
        self.keep = keep
        self.max_workers = max_workers
        self.grace = grace
        # (version, digest) of the newest version this object copied or found the same in
        # both stores: no need to read the origin's manifest again to compare them.
        self._checked: tuple[int, str] | None = None
        #: Model file objects found (or put) in the mirror, checked, by this object.
        self._files_checked: set[str] = set()

    @property
    def name(self) -> str:
        return self.origin.name

    # -- one pass ------------------------------------------------------------------------

    def sync(self, *, stop: threading.Event | None = None) -> MirrorReport:
        """Copy every version the mirror lacks, move its head, prune to ``keep``.

        ``stop`` set during the copy ends it after the version being copied (the mirror is
        valid at every point; the head moves only once it reaches the origin's).
        """
        head = self._origin_head()
        return self._sync(head, stop)

    def _origin_head(self) -> ObjectData | None:
        """The origin's head bytes (read before anything else: it may only name a version
        copied below), checked against the trust policy."""
        key = self.origin.key(keyspace.HEAD)
        try:
            obj = self.origin.store.get(key, max_bytes=MAX_DOCUMENT_BYTES)
        except NotFound:
            return None
        self._check_head(obj)
        return obj

    def _check_head(self, obj: ObjectData) -> None:
        source = self.origin.key(keyspace.HEAD)
        head = parse_head(obj.data, source=source)
        if self.trust is not None:
            self.trust.verify_head(self.name, head, source=source)

    def _sync(self, head: ObjectData | None, stop: threading.Event | None) -> MirrorReport:
        started = time.perf_counter()
        report = MirrorReport(self.name, self.origin.store.url, self.destination.store.url)
        have = self.destination.tip()
        report.from_version = report.to_version = have.version if have else None
        digests: dict[int, str] = {have.version: have.digest} if have else {}
        head_version = parse_head(head.data).version if head is not None else None
        version = self._first_to_copy(have, head_version)
        previous = digests.get(version - 1)
        while True:
            if stop is not None and stop.is_set():
                report.stopped = True
                break
            data = self._origin_manifest(version)
            if data is None:
                break
            previous = self._copy_version(version, data, previous, report)
            digests[version] = previous
            self._checked = (version, previous)
            report.versions.append(version)
            report.to_version = version
            version += 1
        if head is not None and (not report.stopped or head_version in digests):
            self._move_head(head, digests)
        current = self.destination.read_head()
        report.head_version = current.head.version if current else None
        if self.keep is not None:  # every pass: one killed while pruning finishes here
            self._prune(self.keep, report)
        report.seconds = time.perf_counter() - started
        if report.versions:
            log.info(
                "%s: mirrored versions %d..%d (%d objects, %d bytes) into %s",
                self.name,
                report.versions[0],
                report.versions[-1],
                report.objects_copied,
                report.bytes_copied,
                self.destination.store.url,
            )
        return report

    def _prune(self, keep: int, report: MirrorReport) -> None:
        try:
            gc = collect_garbage(self.destination, keep=keep, grace=self.grace)
        except VersionNotFound as exc:  # the origin itself has no keyframe to start the kept versions
            log.warning("%s: the mirror is not pruned: %s", self.name, exc)
            return
        report.pruned_versions = len(gc.deleted_manifests)
        report.pruned_objects = len(gc.deleted_objects)

    def _manifest_key(self, version: int) -> str:
        return self.origin.key(keyspace.manifest_key(version))

    # -- where to start ------------------------------------------------------------------

    def _first_to_copy(self, have: StoredManifest | None, head_version: int | None) -> int:
        """The first version to copy: the one after the mirror's newest, once the origin
        is found to still hold that newest exactly; or, for an empty mirror (or, with
        ``keep``, one too far behind), where the kept versions start."""
        if have is None:
            return self._start_of_kept()
        # Compared once per version: again only if the origin's head went back below it.
        if self._checked != (have.version, have.digest) or head_version is None or head_version < have.version:
            theirs = self._origin_manifest(have.version)
            if theirs is None:
                return self._origin_lost(have.version)
            if sha256_hex(theirs) != have.digest:
                raise ChainMismatch(
                    f"{self.name}: the origin's manifest of version {have.version} is not the one mirrored: the "
                    "origin was rewritten or replaced; a mirror never follows that (recreate it)"
                )
            self._checked = (have.version, have.digest)
        if self.keep is not None and head_version is not None and head_version - have.version > self.keep:
            return max(have.version + 1, self._start_of_kept())  # skip what keep would prune at once
        return have.version + 1

    def _origin_manifest(self, version: int) -> bytes | None:
        try:
            return self.origin.store.get(self._manifest_key(version), max_bytes=MAX_DOCUMENT_BYTES).data
        except NotFound:
            return None

    def _origin_lost(self, version: int) -> int:
        """The origin no longer holds the mirror's newest version."""
        tip = self.origin.tip()
        if tip is None or tip.version < version:
            raise RunRewound(
                f"{self.name}: the mirror holds version {version}, the origin's newest is "
                f"{tip.version if tip else 'none'}: the origin was rolled back; a mirror never goes back"
            )
        if self.keep is None:
            raise VersionNotFound(
                f"{self.name}: the origin no longer holds version {version} (garbage-collected), so the "
                "versions after it cannot be checked against the mirror's chain; mirror with keep (--keep) "
                "to start again from the origin's kept versions, or into a fresh store"
            )
        return self._start_of_kept()

    def _start_of_kept(self) -> int:
        """The oldest version to copy: the origin's oldest, or, with ``keep``, the newest
        keyframe at or below the oldest of the newest ``keep`` versions."""
        if self.keep is None:
            versions = self.origin.versions()
            return versions[0] if versions else 1
        tip = self.origin.tip()
        if tip is None:
            return 1
        floor = max(1, tip.version - self.keep + 1)
        stored = tip
        while not (stored.version <= floor and stored.manifest.keyframe is not None):
            try:
                stored = self.origin.read_manifest(stored.version - 1)
            except VersionNotFound:  # the origin keeps no keyframe below: start at its oldest
                break
        return stored.version

    # -- one version -----------------------------------------------------------------------

    def _copy_version(self, version: int, data: bytes, previous: str | None, report: MirrorReport) -> str:
        """Copy the objects of the manifest ``data`` of ``version``, its signature, then
        create it; returns its digest."""
        key = self._manifest_key(version)
        digest = sha256_hex(data)
        signature = self.origin.read_signature(digest)
        if self.trust is not None:
            self.trust.verify_manifest(self.name, digest, signature, source=key)
        manifest = parse_manifest(data, source=key)
        if manifest.run != self.name or manifest.version != version:
            raise FormatError(f"{key}: holds {manifest.run} version {manifest.version}")
        if previous is not None and manifest.parent_digest != previous:
            raise ChainMismatch(
                f"{self.name}: the origin's version {version} does not chain to the version {version - 1} "
                "mirrored: the origin was rewritten; a mirror never follows that (recreate it)"
            )
        # A model file that several versions name is checked in the mirror once per Mirror.
        refs = [ref for ref in _object_refs(manifest) if ref.key not in self._files_checked]
        self._copy_objects(refs, report)
        self._files_checked.update(ref.key for ref in manifest_files(manifest))
        if signature is not None:
            self._create(keyspace.signature_key(digest), signature, "signature")
        self._create(keyspace.manifest_key(version), data, "manifest")
        return digest

    def _copy_objects(self, refs: Sequence[ObjectRef], report: MirrorReport) -> None:
        """Make every object of ``refs`` present and checked in the mirror, in parallel:
        those already there are checked, the others copied (each checked as read)."""
        present = self._present(refs)
        with ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="bulletin-mirror") as pool:
            pending: set[Future[int | None]] = {pool.submit(self._copy_object, ref, present) for ref in refs}
            try:
                while pending:
                    done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                    for future in done:
                        copied = future.result()  # the first error is raised here
                        if copied is None:
                            report.objects_checked += 1
                        else:
                            report.objects_copied += 1
                            report.bytes_copied += copied
            finally:
                for future in pending:
                    future.cancel()

    def _present(self, refs: Sequence[ObjectRef]) -> dict[str, int]:
        """Relative key -> size of the objects of ``refs`` already in the mirror: one
        listing per folder they sit in (in a fresh copy, an empty one)."""
        folders = sorted({ref.key.rsplit("/", 1)[0] + "/" for ref in refs})
        wanted = {ref.key for ref in refs}
        root = len(self.destination.root)
        found: dict[str, int] = {}
        for folder in folders:
            for info in self.destination.objects(folder):
                relative = info.key[root:]
                if relative in wanted:
                    found[relative] = info.size
        return found

    def _copy_object(self, ref: ObjectRef, present: dict[str, int]) -> int | None:
        """Check ``ref`` in the mirror (None) or copy it there (its size)."""
        if ref.key in present:
            self._check_present(ref, present[ref.key])
            return None
        (data,) = self.origin.download([ref])  # checked (size, SHA-256), refetched once if bad
        result = self.destination.store.put_if_absent(self.destination.key(ref.key), data)
        if isinstance(result, Conflicted):  # created meanwhile (another copy of this mirror)
            self._check_present(ref, None)
            return None
        return len(data)

    def _check_present(self, ref: ObjectRef, size: int | None) -> None:
        key = self.destination.key(ref.key)
        if size is not None and size != ref.size:
            raise self._corrupt(key, f"{size} bytes, the manifest promises {ref.size}")
        try:
            data = self.destination.store.get(key, max_bytes=ref.size).data
        except ObjectTooLarge:
            raise self._corrupt(key, f"larger than the {ref.size} bytes the manifest promises") from None
        digest = sha256_hex(data)
        if len(data) != ref.size or digest != ref.sha256:
            raise self._corrupt(key, f"sha256 {digest[:16]}..., the manifest promises {ref.sha256[:16]}...")

    def _corrupt(self, key: str, detail: str) -> CorruptData:
        return CorruptData(
            f"{self.destination.store.url}: {key} is in the mirror with other bytes ({detail}); it is not "
            "overwritten: find out why, then delete it (or recreate the mirror)"
        )

    def _create(self, relative: str, data: bytes, what: str) -> None:
        """Create a document verbatim; one already there must hold exactly these bytes."""
        key = self.destination.key(relative)
        if isinstance(self.destination.store.put_if_absent(key, data), Updated):
            return
        try:
            existing: bytes | None = self.destination.store.get(key, max_bytes=len(data)).data
        except ObjectTooLarge:
            existing = None
        if existing == data:
            return  # created by an earlier, interrupted copy
        if what == "manifest":
            raise ChainMismatch(
                f"{self.name}: the mirror {self.destination.store.url} holds another {key}: it is a copy of "
                "another chain (or the origin was rewritten); recreate it"
            )
        raise CorruptData(f"{self.destination.store.url}: {key} ({what}) is in the mirror with other bytes")

    # -- the head ------------------------------------------------------------------------

    def _move_head(self, head: ObjectData, digests: dict[int, str]) -> None:
        """Put the origin's head bytes in the mirror, by compare-and-swap, only forward, and
        only if the mirror holds the very manifest the head names."""
        parsed = parse_head(head.data)
        digest = digests.get(parsed.version)
        if digest is None:
            try:
                digest = self.destination.read_manifest(parsed.version).digest
            except VersionNotFound:
                digest = None
        if digest != parsed.manifest_digest:
            log.warning(
                "%s: the origin's head names version %d (manifest %s...), which the mirror does not hold as "
                "such; its head is left where it is",
                self.name,
                parsed.version,
                parsed.manifest_digest[:16],
            )
            return
        key = self.destination.key(keyspace.HEAD)
        for _ in range(_HEAD_ATTEMPTS):
            try:
                current: ObjectData | None = self.destination.store.get(key, max_bytes=MAX_DOCUMENT_BYTES)
            except NotFound:
                current = None
            if current is None:
                result = self.destination.store.put_if_absent(key, head.data)
            elif current.data == head.data or parse_head(current.data, source=key).version >= parsed.version:
                return  # never backwards
            else:
                result = self.destination.store.put_if_match(key, head.data, current.etag)
            if isinstance(result, Updated):
                return
        raise ChainMismatch(f"{self.name}: the mirror's head kept changing under {_HEAD_ATTEMPTS} attempts")

    # -- following -----------------------------------------------------------------------

    def follow(
        self,
        *,
        interval: float = 2.0,
        stop: threading.Event | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Iterator[MirrorReport]:
        """Copy what is there, then poll the origin's head every ``interval`` seconds (one
        conditional GET: a small ``304`` while unchanged) and copy each new version;
        yields the report of every pass that created something. Failures go to
        ``on_error`` (re-raised without one) and the next poll tries again."""
        stop = stop or threading.Event()
        key = self.origin.key(keyspace.HEAD)
        etag: str | None = None
        first = True
        while not stop.is_set():
            started = time.monotonic()
            try:
                try:
                    head = self.origin.store.get_if_changed(key, etag, max_bytes=MAX_DOCUMENT_BYTES)
                except NotFound:
                    head = None
                if head is not None:
                    self._check_head(head)
                if head is not None or first:
                    report = self._sync(head, stop)
                    first = False
                    etag = head.etag if head is not None else etag
                    if report.versions:
                        yield report
            except Exception as exc:
                etag = None  # read and copy everything again next time
                if on_error is None:
                    raise
                on_error(exc)
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def close(self) -> None:
        self.origin.store.close()
        self.destination.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
