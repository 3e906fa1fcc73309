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
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from bulletin import keyspace
from bulletin.errors import (
    Conflict,
    DigestMismatch,
    FormatError,
    NotFound,
    VersionConflict,
    VersionNotFound,
)
from bulletin.storage import Conflicted, ObjectInfo, Store, Updated, get_many, put_many_if_absent
from schemas.common import MAX_DOCUMENT_BYTES
from schemas.head import HeadV1, parse_head
from schemas.manifest import ManifestV1, ObjectRef, parse_manifest

__all__ = ["Run", "StoredHead", "StoredManifest", "sha256_hex"]

#: How far past the head :meth:`Run.tip` looks for committed versions.
_PROBE_LIMIT: Final = 1_000


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
    head: HeadV1
    etag: str


def verify_object(ref: ObjectRef, data: bytes) -> None:
    """Raise ``DigestMismatch`` unless ``data`` is exactly what ``ref`` promises."""
    if len(data) != ref.size:
        raise DigestMismatch(f"{ref.key}: {len(data)} bytes, the manifest promises {ref.size}")
    digest = sha256_hex(data)
    if digest != ref.sha256:
        raise DigestMismatch(f"{ref.key}: sha256 {digest[:16]}..., the manifest promises {ref.sha256[:16]}...")


class Run:
    """A run (``<prefix>/<run>/``) in a store: its head, manifests and data objects."""

    def __init__(self, store: Store, name: str, *, max_workers: int = 8) -> None:
        self.store = store
        self.name = keyspace.check_run_name(name)
        self.root = keyspace.run_root(name)
        self.max_workers = max_workers

    def key(self, relative: str) -> str:
        return self.root + relative

    # -- head ------------------------------------------------------------------------

    def read_head(self) -> StoredHead | None:
        """The head, or None for a run with no version yet."""
        try:
            obj = self.store.get(self.key(keyspace.HEAD))
        except NotFound:
            return None
        return StoredHead(parse_head(obj.data, source=self.key(keyspace.HEAD)), obj.etag)

    def poll_head(self, etag: str | None) -> StoredHead | None:
        """One conditional GET: None when the head is unchanged since ``etag`` (or absent)."""
        try:
            obj = self.store.get_if_changed(self.key(keyspace.HEAD), etag)
        except NotFound:
            return None
        if obj is None:
            return None
        return StoredHead(parse_head(obj.data, source=self.key(keyspace.HEAD)), obj.etag)

    def advance_head(self, stored: StoredManifest) -> bool:
        """Move the head to ``stored`` unless it already points at it or later.

        Returns True when this call moved it. Compare-and-swap in a loop: a lost race
        re-reads and retries only while the head is still behind.
        """
        head = HeadV1(
            run=self.name,
            version=stored.version,
            manifest_digest=stored.digest,
            updated_at=datetime.now(UTC),
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

    # -- manifests ---------------------------------------------------------------------

    def read_manifest(self, version: int) -> StoredManifest:
        key = self.key(keyspace.manifest_key(version))
        try:
            obj = self.store.get(key)
        except NotFound:
            raise VersionNotFound(f"{self.name}: version {version} does not exist") from None
        manifest = parse_manifest(obj.data, source=key)
        if manifest.version != version or manifest.run != self.name:
            raise FormatError(f"{key}: holds {manifest.run} version {manifest.version}")
        return StoredManifest(manifest, sha256_hex(obj.data), len(obj.data))

    def read_manifests(self, versions: Sequence[int]) -> list[StoredManifest]:
        """Several manifests fetched in parallel, in the order asked."""
        keys = [self.key(keyspace.manifest_key(v)) for v in versions]
        try:
            blobs = get_many(self.store, keys, max_workers=self.max_workers)
        except NotFound as exc:
            raise VersionNotFound(f"{self.name}: {exc}") from None
        out = []
        for version, key in zip(versions, keys, strict=True):
            manifest = parse_manifest(blobs[key], source=key)
            if manifest.version != version or manifest.run != self.name:
                raise FormatError(f"{key}: holds {manifest.run} version {manifest.version}")
            out.append(StoredManifest(manifest, sha256_hex(blobs[key]), len(blobs[key])))
        return out

    def versions(self) -> list[int]:
        """Every committed version still in the bucket, ascending (one listing)."""
        prefix = self.key(keyspace.MANIFESTS)
        return [keyspace.parse_manifest_key(info.key[len(self.root) :]) for info in self.store.list(prefix)]

    def tip(self) -> StoredManifest | None:
        """The newest committed version: the head's, or a later one it has not caught up with."""
        head = self.read_head()
        if head is None:
            found = self.versions()
            if not found:
                return None
            return self.read_manifest(found[-1])
        newest = self.read_manifest(head.head.version)
        for _ in range(_PROBE_LIMIT):
            try:
                newest = self.read_manifest(newest.version + 1)
            except VersionNotFound:
                return newest
        return newest

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
                existing = self.store.get(key).data
                if existing != absolute[key]:
                    raise Conflict(f"{key}: exists with other content")

    def download(self, refs: Sequence[ObjectRef], on_bytes: Callable[[int], None] | None = None) -> list[bytes]:
        """Fetch objects in parallel and verify each against its size and SHA-256."""
        keys = [self.key(ref.key) for ref in refs]
        try:
            blobs = get_many(self.store, keys, max_workers=self.max_workers, on_bytes=on_bytes)
        except NotFound as exc:
            raise DigestMismatch(f"{self.name}: an object a manifest names is missing: {exc}") from exc
        out = []
        for ref, key in zip(refs, keys, strict=True):
            verify_object(ref, blobs[key])
            out.append(blobs[key])
        return out

    # -- commit ------------------------------------------------------------------------

    def commit(self, manifest: ManifestV1) -> StoredManifest:
        """Create the manifest (the commit point), then move the head.

        Raises ``VersionConflict`` when another writer committed that version first.
        """
        if manifest.run != self.name:
            raise FormatError(f"manifest of run {manifest.run!r} committed to run {self.name!r}")
        data = manifest.model_dump_json().encode()
        if len(data) > MAX_DOCUMENT_BYTES:
            raise FormatError(f"manifest of {len(data)} bytes exceeds the {MAX_DOCUMENT_BYTES} cap")
        result = self.store.put_if_absent(self.key(keyspace.manifest_key(manifest.version)), data)
        if isinstance(result, Conflicted):
            raise VersionConflict(
                f"{self.name}: version {manifest.version} was committed by another writer; "
                "this trainer is stale (another one is publishing to the same run)"
            )
        stored = StoredManifest(manifest, sha256_hex(data), len(data))
        self.advance_head(stored)
        return stored
