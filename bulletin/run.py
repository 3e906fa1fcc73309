"""A run inside a store (:class:`Run`): reading its manifest chain, and the commit protocol.

The commit protocol (DESIGN invariant 1, FORMAT.md "Commit protocol"):

1. every shard and keyframe file is written create-only under a key nobody else
   can want with different bytes (content digest or writer id in the key);
2. the manifest is created with If-None-Match: exactly one writer creates version
   N; that creation is the commit point;
3. the head is moved forward by compare-and-swap on its ETag, never backwards.

A crash before 2 leaves orphans and no version; a crash between 2 and 3 leaves a
committed version that the head does not show yet: :meth:`Run.tip` finds it by
probing past the head, and the next commit moves the head over it.

Signed versions (docs/SECURITY.md): a Run with a ``signer`` writes each manifest's
detached signature create-only just before the manifest (step 2 stays the commit
point) and signed heads; a Run with a ``trust`` policy checks every head it reads and
every manifest it reads by number against it, before parsing the manifest and before
anything is downloaded. Manifests read down the chain (:meth:`Run.ancestors`) need no
signature of their own: each is the exact bytes its checked child names.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from bulletin import keyspace
from bulletin.errors import (
    AccessDenied,
    BadSignature,
    Conflict,
    CorruptData,
    DigestMismatch,
    FormatError,
    InvalidInput,
    NotFound,
    ObjectTooLarge,
    StorageUnavailable,
    VersionConflict,
    VersionNotFound,
)
from bulletin.storage import Conflicted, ObjectData, ObjectInfo, Store, Updated, get_many, put_many_if_absent
from schemas.common import MAX_DOCUMENT_BYTES
from schemas.head import Head, HeadV1, parse_head
from schemas.manifest import ManifestV1, ObjectRef, parse_manifest
from schemas.signature import MAX_SIGNATURE_BYTES

if TYPE_CHECKING:
    from bulletin.signing import Signer, TrustPolicy

__all__ = ["Run", "StoredHead", "StoredManifest", "sha256_hex"]

#: How far past the head :meth:`Run.tip` looks for committed versions.
_PROBE_LIMIT: Final = 1_000
#: What a manifest may hold beyond the tensor list it shares with a version that patches
#: it (FORMAT.md, "Manifests"): metadata (6.4 MiB at most) and object refs.
MANIFEST_SLACK: Final = 8 << 20
#: Manifest bytes read ahead at most while walking down a chain (bounds how many are
#: fetched at once: as many as workers when they are small, one when they are large).
_READ_AHEAD_BYTES: Final = 64 << 20

log = logging.getLogger("bulletin.run")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredManifest:
    """A manifest with the digest of its exact bytes (what the next version chains to)."""

    manifest: ManifestV1
    digest: str
    size: int

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass(frozen=True, slots=True)
class StoredHead:
    head: Head
    etag: str


def verify_object(ref: ObjectRef, data: bytes) -> None:
    """Raise ``DigestMismatch`` unless ``data`` is exactly what ``ref`` promises."""
    if len(data) != ref.size:
        raise DigestMismatch(f"{ref.key}: {len(data)} bytes, the manifest promises {ref.size}")
    digest = sha256_hex(data)
    if digest != ref.sha256:
        raise DigestMismatch(f"{ref.key}: sha256 {digest[:16]}..., the manifest promises {ref.sha256[:16]}...")


class Run:
    """A run (``<prefix>/<run>/``) in a store: its head, manifests and data objects.

    ``trust``: every head read, and every manifest read by version number, must pass
    this policy (``UntrustedVersion`` otherwise, raised as it is read). ``signer``:
    manifests committed and heads moved are signed with it.
    """

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        max_workers: int = 8,
        trust: TrustPolicy | None = None,
        signer: Signer | None = None,
    ) -> None:
        self.store = store
        self.name = keyspace.check_run_name(name)
        self.root = keyspace.run_root(name)
        self.max_workers = max_workers
        self.trust = trust
        self.signer = signer

    def key(self, relative: str) -> str:
        return self.root + relative

    # -- head ------------------------------------------------------------------------

    def read_head(self) -> StoredHead | None:
        """The head, or None for a run with no version yet."""
        try:
            obj = self.store.get(self.key(keyspace.HEAD), max_bytes=MAX_DOCUMENT_BYTES)
        except NotFound:
            return None
        return self._head(obj)

    def poll_head(self, etag: str | None) -> StoredHead | None:
        """One conditional GET: None when the head is unchanged since ``etag`` (or absent)."""
        try:
            obj = self.store.get_if_changed(self.key(keyspace.HEAD), etag, max_bytes=MAX_DOCUMENT_BYTES)
        except NotFound:
            return None
        if obj is None:
            return None
        return self._head(obj)

    def _head(self, obj: ObjectData) -> StoredHead:
        source = self.key(keyspace.HEAD)
        head = parse_head(obj.data, source=source)
        if self.trust is not None:
            self.trust.verify_head(self.name, head, source=source)
        return StoredHead(head, obj.etag)

    def advance_head(self, stored: StoredManifest) -> bool:
        """Move the head to ``stored`` unless it already points at it or later.

        Returns True when this call moved it. Compare-and-swap in a loop: a lost race
        re-reads and retries only while the head is still behind.
        """
        now = datetime.now(UTC)
        head: Head = (
            HeadV1(run=self.name, version=stored.version, manifest_digest=stored.digest, updated_at=now)
            if self.signer is None
            else self.signer.sign_head(self.name, stored.version, stored.digest, now)
        )
        data = head.model_dump_json().encode()
        key = self.key(keyspace.HEAD)
        for _ in range(100):
            current = self.read_head()
            if current is None:
                result = self.store.put_if_absent(key, data)
            elif current.head.version >= stored.version:
                return False
            else:
                result = self.store.put_if_match(key, data, current.etag)
            if isinstance(result, Updated):
                return True
        raise Conflict(f"{self.name}: the head kept changing under 100 compare-and-swap attempts")

    def refresh_head(self, stored: StoredManifest) -> bool:
        """Sign the head again with a new ``updated_at``, if it still names ``stored`` (its
        version and digest): a signing writer's heartbeat, so that readers' staleness bound
        does not refuse a run whose trainer is only quiet. Returns whether it did; a head
        naming anything else (a newer version, or something this writer did not write) is
        left alone, never signed again."""
        if self.signer is None:
            raise InvalidInput(f"{self.name}: only a signing writer refreshes the head")
        key = self.key(keyspace.HEAD)
        for _ in range(100):
            current = self.read_head()
            if current is None or (current.head.version, current.head.manifest_digest) != (
                stored.version,
                stored.digest,
            ):
                return False
            head = self.signer.sign_head(self.name, stored.version, stored.digest, datetime.now(UTC))
            if isinstance(self.store.put_if_match(key, head.model_dump_json().encode(), current.etag), Updated):
                return True
        raise Conflict(f"{self.name}: the head kept changing under 100 compare-and-swap attempts")

    # -- manifests ---------------------------------------------------------------------

    def read_manifest(
        self, version: int, *, max_bytes: int = MAX_DOCUMENT_BYTES, known_digest: str | None = None
    ) -> StoredManifest:
        """The manifest of ``version``; ``ObjectTooLarge`` over ``max_bytes`` (refused unread).
        Under a trust policy, its signature is checked before it is parsed, unless its bytes
        hash to ``known_digest``: a manifest the caller verified when it took that version
        (a node's held one), which a key retired since must not make unreadable."""
        key = self._manifest_key(version)
        try:
            obj = self.store.get(key, max_bytes=max_bytes)
        except NotFound:
            raise VersionNotFound(f"{self.name}: version {version} does not exist") from None
        digest = sha256_hex(obj.data)
        if self.trust is not None and digest != known_digest:
            self.trust.verify_manifest(self.name, digest, self.read_signature(digest), source=key)
        return self._stored(version, key, obj.data, digest)

    def read_manifests(self, versions: Sequence[int]) -> list[StoredManifest]:
        """Several manifests, in the order asked: fetched in parallel, a batch of
        ``max_workers`` at a time, each parsed as its batch arrives (so that no more than
        a batch of raw documents is held at once)."""
        out: list[StoredManifest] = []
        for first in range(0, len(versions), self.max_workers):
            batch = versions[first : first + self.max_workers]
            keys = [self._manifest_key(v) for v in batch]
            try:
                blobs = get_many(self.store, keys, max_workers=self.max_workers, max_bytes=MAX_DOCUMENT_BYTES)
            except NotFound as exc:
                raise VersionNotFound(f"{self.name}: {exc}") from None
            digests = [sha256_hex(blobs[key]) for key in keys]
            if self.trust is not None:
                with ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="bulletin-sig") as pool:
                    documents = list(pool.map(self.read_signature, digests))
                for key, digest, document in zip(keys, digests, documents, strict=True):
                    self.trust.verify_manifest(self.name, digest, document, source=key)
            out.extend(
                self._stored(version, key, blobs[key], digest)
                for version, key, digest in zip(batch, keys, digests, strict=True)
            )
            del blobs
        return out

    def ancestors(self, child: StoredManifest, *, floor: int = 1) -> Iterator[StoredManifest]:
        """The versions a route to ``child`` may pass through, newest first: its parent,
        the parent's parent, ... down to ``floor``, while each one read has a patch.

        Each manifest is checked to be the exact bytes its child names (``parent_digest``:
        ``CorruptData`` otherwise) before it is parsed, so a forged one costs its bytes
        only. A version with a patch lists its parent's tensors, so every manifest read
        lists ``child``'s: one larger than ``2 * child.size + MANIFEST_SLACK`` is
        ``ObjectTooLarge``, refused unread. The walk ends after a version without a patch
        (nothing older is on any route) and before a missing one (garbage collected).
        Manifests are read ahead in parallel, at most ``_READ_AHEAD_BYTES`` of them.
        Under a trust policy they need no signature of their own: the digest check ties
        each to ``child``, whose own signature (or its child's, ...) was checked.
        """
        if child.manifest.patch is None or child.version - 1 < floor:
            return
        first = child.version
        cap = min(MAX_DOCUMENT_BYTES, 2 * child.size + MANIFEST_SLACK)
        ahead = max(1, min(self.max_workers, _READ_AHEAD_BYTES // cap))
        versions = iter(range(child.version - 1, floor - 1, -1))
        pending: deque[tuple[int, Future[ObjectData]]] = deque()
        with ThreadPoolExecutor(max_workers=ahead, thread_name_prefix="bulletin-walk") as pool:
            try:
                while True:
                    while len(pending) < ahead and (version := next(versions, None)) is not None:
                        pending.append(
                            (version, pool.submit(self.store.get, self._manifest_key(version), max_bytes=cap))
                        )
                    if not pending:
                        return
                    version, future = pending.popleft()
                    try:
                        data = future.result().data
                    except NotFound:
                        return
                    except ObjectTooLarge as exc:
                        raise ObjectTooLarge(
                            f"{self.name}: the manifest of version {version} is larger than one below version "
                            f"{first} can be: {exc}"
                        ) from exc
                    digest = sha256_hex(data)
                    if digest != child.manifest.parent_digest:
                        raise CorruptData(
                            f"{self.name}: version {child.version} does not chain to version {version} "
                            "(parent digest mismatch): the bucket was rewritten or forked"
                        )
                    child = self._stored(version, self._manifest_key(version), data, digest)
                    del data
                    yield child
                    if child.manifest.patch is None:
                        return
            finally:
                for _, pending_future in pending:
                    pending_future.cancel()

    def _manifest_key(self, version: int) -> str:
        return self.key(keyspace.manifest_key(version))

    def read_signature(self, manifest_digest: str) -> bytes | None:
        """The bytes of the detached signature of the manifest ``manifest_digest``, or None."""
        key = self.key(keyspace.signature_key(manifest_digest))
        try:
            return self.store.get(key, max_bytes=MAX_SIGNATURE_BYTES).data
        except NotFound:
            return None
        except ObjectTooLarge as exc:
            raise BadSignature(f"{key}: larger than any signature document: {exc}") from exc

    def _stored(self, version: int, key: str, data: bytes, digest: str | None = None) -> StoredManifest:
        manifest = parse_manifest(data, source=key)
        if manifest.version != version or manifest.run != self.name:
            raise FormatError(f"{key}: holds {manifest.run} version {manifest.version}")
        return StoredManifest(manifest, digest or sha256_hex(data), len(data))

    def versions(self) -> list[int]:
        """Every committed version still in the bucket, ascending (one listing)."""
        prefix = self.key(keyspace.MANIFESTS)
        return [keyspace.parse_manifest_key(info.key[len(self.root) :]) for info in self.store.list(prefix)]

    def tip(self) -> StoredManifest | None:
        """The newest committed version: the head's, or a later one it has not caught up with.

        A head naming a version that is not in the bucket (a partial rollback, a garbage
        collection racing the head) does not block readers: the newest version the
        listing holds is the tip then, with a warning. It may be older than a version a
        reader already holds; telling a rollback apart is the reader's business.
        """
        head = self.read_head()
        if head is None:
            return self._newest_listed()
        try:
            newest = self.read_manifest(head.head.version)
        except VersionNotFound:
            listed = self._newest_listed()
            log.warning(
                "%s: the head names version %d, which is not in the bucket; the newest version there is %s",
                self.name,
                head.head.version,
                listed.version if listed else "none",
            )
            if listed is None:
                return None
            newest = listed
        for _ in range(_PROBE_LIMIT):
            try:
                newest = self.read_manifest(newest.version + 1)
            except VersionNotFound:
                return newest
        return newest

    def _newest_listed(self) -> StoredManifest | None:
        """The newest version a listing shows and that can still be read, or None."""
        for version in reversed(self.versions()):
            try:
                return self.read_manifest(version)
            except VersionNotFound:  # deleted since the listing
                continue
        return None

    def objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.store.list(self.key(prefix))

    # -- data objects ------------------------------------------------------------------

    def upload(self, items: Mapping[str, bytes], on_bytes: Callable[[int], None] | None = None) -> None:
        """Create data objects (relative keys) in parallel, create-only.

        A key that already exists is fine only if its bytes are ours: patch shards are
        content-addressed, so an existing shard is the same shard; anything else is a
        conflict (a keyframe prefix is unique to its writer).
        """
        absolute = {self.key(k): v for k, v in items.items()}
        results = put_many_if_absent(self.store, absolute, max_workers=self.max_workers, on_bytes=on_bytes)
        for key, result in results.items():
            if isinstance(result, Conflicted):
                try:
                    existing: bytes | None = self.store.get(key, max_bytes=len(absolute[key])).data
                except ObjectTooLarge:
                    existing = None
                if existing != absolute[key]:
                    raise Conflict(f"{key}: exists with other content")

    def download(self, refs: Sequence[ObjectRef], on_bytes: Callable[[int], None] | None = None) -> list[bytes]:
        """Fetch objects in parallel and verify each against its size and SHA-256.

        An object that fails its check is fetched once more (the transfer may have gone
        wrong, not the object) and refused with ``DigestMismatch`` if it fails again.
        """
        out = []
        for ref, fetched in zip(refs, self._fetch(refs, on_bytes), strict=True):
            try:
                verify_object(ref, fetched)
            except DigestMismatch as exc:
                out.append(self._refetch(ref, exc, on_bytes))
            else:
                out.append(fetched)
        return out

    def download_file(
        self, ref: ObjectRef, path: str | os.PathLike[str], on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """Stream one object to the local file ``path`` in bounded memory, verified as it
        arrives against its size (the read's bound) and SHA-256 (:meth:`Store.get_to_file`:
        a temp file renamed into place only once it checks). Fetched once more if the
        check fails, then ``DigestMismatch``, as :meth:`download`; a missing object, or one
        larger than promised, is ``DigestMismatch`` too. ``on_bytes(size)`` once it is in."""
        key = self.key(ref.key)
        failure: DigestMismatch | None = None
        for _ in range(2):
            try:
                done = self.store.get_to_file(key, path, sha256=ref.sha256, max_bytes=ref.size)
                if done.size != ref.size:
                    raise DigestMismatch(f"{ref.key}: {done.size} bytes, the manifest promises {ref.size}")
            except NotFound as exc:
                raise DigestMismatch(f"{self.name}: an object a manifest names is missing: {exc}") from exc
            except ObjectTooLarge as exc:
                raise DigestMismatch(f"{self.name}: an object is larger than its manifest promises: {exc}") from exc
            except DigestMismatch as exc:
                if failure is not None:
                    raise DigestMismatch(f"{exc} (fetched twice)") from failure
                log.info("%s: %s; fetching it once more", self.name, exc)
                failure = exc
                continue
            if on_bytes is not None:
                on_bytes(done.size)
            return

    def _fetch(self, refs: Sequence[ObjectRef], on_bytes: Callable[[int], None] | None) -> list[bytes]:
        """The objects' bytes, read in parallel, not verified yet; a missing one is corrupt data."""
        keys = [self.key(ref.key) for ref in refs]
        sizes = {key: ref.size for key, ref in zip(keys, refs, strict=True)}  # refused unread if larger
        try:
            blobs = get_many(self.store, keys, max_workers=self.max_workers, on_bytes=on_bytes, max_bytes=sizes)
        except NotFound as exc:
            raise DigestMismatch(f"{self.name}: an object a manifest names is missing: {exc}") from exc
        except ObjectTooLarge as exc:
            raise DigestMismatch(f"{self.name}: an object is larger than its manifest promises: {exc}") from exc
        return [blobs[key] for key in keys]

    def _refetch(self, ref: ObjectRef, failure: DigestMismatch, on_bytes: Callable[[int], None] | None) -> bytes:
        """One more read of an object whose first copy failed its check; ``DigestMismatch``
        if the second fails too (the object itself is bad: no further retries)."""
        log.info("%s: %s; fetching it once more", self.name, failure)
        (data,) = self._fetch([ref], on_bytes)
        try:
            verify_object(ref, data)
        except DigestMismatch as again:
            raise DigestMismatch(f"{again} (fetched twice)") from failure
        return data

    # -- commit ------------------------------------------------------------------------

    def commit(self, manifest: ManifestV1) -> StoredManifest:
        """Create the manifest (the commit point), then move the head.

        A create-only PUT whose outcome is in doubt (a lost response, a conflict) is
        settled by reading the manifest back: holding exactly these bytes (they carry
        the writer id and the commit time), it is this writer's own commit and counts
        as made, so committing the same manifest again is safe. Raises
        ``VersionConflict`` when another writer committed that version, and
        ``StorageUnavailable`` when the store failed and the outcome is still unknown
        (commit the same manifest again to settle it). Once the manifest exists, a
        store failure while moving the head is only logged: the version is committed,
        readers find it past the head, and the next commit moves the head over it.
        """
        if manifest.run != self.name:
            raise FormatError(f"manifest of run {manifest.run!r} committed to run {self.name!r}")
        data = manifest.model_dump_json().encode()
        if len(data) > MAX_DOCUMENT_BYTES:
            raise FormatError(f"manifest of {len(data)} bytes exceeds the {MAX_DOCUMENT_BYTES} cap")
        key = self.key(keyspace.manifest_key(manifest.version))
        digest = sha256_hex(data)
        if self.signer is not None:
            self._put_signature(self.signer, digest)  # before the manifest: readers never see it unsigned
        try:
            result = self.store.put_if_absent(key, data)
        except AccessDenied:
            raise
        except StorageUnavailable as exc:
            self._settle(manifest, key, data, exc)
        else:
            if isinstance(result, Conflicted):
                self._settle(manifest, key, data, None)
        stored = StoredManifest(manifest, digest, len(data))
        try:
            self.advance_head(stored)
        except AccessDenied:
            raise
        except StorageUnavailable as exc:
            log.warning("%s: version %d is committed; the head was not moved: %s", self.name, stored.version, exc)
        return stored

    def _put_signature(self, signer: Signer, manifest_digest: str) -> None:
        """Create the manifest's detached signature. Ed25519 is deterministic, so a commit
        that runs again (an outcome in doubt) finds exactly its own bytes there."""
        data = signer.sign_manifest(manifest_digest).model_dump_json().encode()
        key = self.key(keyspace.signature_key(manifest_digest))
        if isinstance(self.store.put_if_absent(key, data), Conflicted):
            try:
                existing: bytes | None = self.store.get(key, max_bytes=len(data)).data
            except (NotFound, ObjectTooLarge):
                existing = None
            if existing != data:
                raise Conflict(f"{key}: exists with other content (signed by another key?)")

    def _settle(self, manifest: ManifestV1, key: str, data: bytes, failure: StorageUnavailable | None) -> None:
        """Decide a manifest creation that did not plainly succeed by reading it back.

        Returns when the manifest holds exactly ``data`` (this writer's commit); raises
        ``VersionConflict`` when it holds another, ``StorageUnavailable`` when the
        store failed (``failure``) and the read-back cannot tell.
        """
        version = manifest.version
        try:
            existing = self.store.get(key, max_bytes=MAX_DOCUMENT_BYTES).data
        except ObjectTooLarge:  # not what this writer sent, nor any manifest
            raise VersionConflict(
                f"{self.name}: version {version} is taken by an object too large for a manifest"
            ) from None
        except NotFound:
            if failure is not None:  # the PUT failed and nothing is there: not committed
                raise failure from failure.__cause__
            raise VersionConflict(  # lost to a manifest that is gone again: not ours
                f"{self.name}: version {version} was committed by another writer, then removed"
            ) from None
        except StorageUnavailable as exc:
            cause = failure or exc
            raise StorageUnavailable(
                f"{self.name}: the commit of version {version} may or may not have taken effect "
                f"({cause}); committing the same manifest again settles it"
            ) from cause
        if existing == data:
            if failure is not None:
                log.info("%s: version %d was committed; its response was lost", self.name, version)
            return
        try:
            writer = parse_manifest(existing, source=key).writer
        except FormatError:
            writer = "unknown"
        raise VersionConflict(
            f"{self.name}: version {version} was committed by another writer ({writer}, not {manifest.writer}); "
            "this trainer is stale (another one is publishing to the same run)"
        )
