"""What the mirror tests share: checking a mirror's store, and stores that record or fail
on purpose (wrapping real stores; the production code knows nothing of them). Reads are
counted by scripts/bench_mirror.py's ``Egress``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from bulletin.errors import StorageUnavailable
from bulletin.keyspace import HEAD, manifest_key
from bulletin.run import Run, sha256_hex
from bulletin.storage import ObjectData, ObjectInfo, Store, WriteResult, open_store
from bulletin.storage.wrapper import WrapperStore
from schemas.manifest import parse_manifest


def assert_valid_mirror(url: str | Store, run: str = "run", *, gap: bool = False) -> list[int]:
    """The guarantees a mirror keeps at every instant: its versions are contiguous (``gap``:
    but for one gap, below which a mirror that skipped to its kept versions keeps the old
    ones until it prunes them); every manifest there has all its objects, intact, and
    chains to the one below it; its head (if any) names a version it holds, with that
    manifest's digest. Returns the versions."""
    store = open_store(url) if isinstance(url, str) else url
    mirror = Run(store, run)
    versions = mirror.versions()
    breaks = [v for v in versions[1:] if v - 1 not in versions]
    assert len(breaks) <= (1 if gap else 0), f"gaps in {versions}"
    if breaks:
        assert mirror.read_manifest(breaks[0]).manifest.keyframe is not None, "a range must start at a keyframe"
    digests: dict[int, str] = {}
    for version in versions:
        data = store.get(mirror.key(manifest_key(version))).data
        manifest = parse_manifest(data)
        refs = list(manifest.patch.shards if manifest.patch else ()) + list(
            manifest.keyframe.files if manifest.keyframe else ()
        )
        for ref in refs:
            got = store.get(mirror.key(ref.key)).data  # NotFound: a version shown without its objects
            assert len(got) == ref.size and sha256_hex(got) == ref.sha256, f"version {version}: {ref.key} is bad"
        if version - 1 in digests:
            assert manifest.parent_digest == digests[version - 1], f"version {version} does not chain"
        digests[version] = sha256_hex(data)
    head = mirror.read_head()
    if head is not None:
        assert head.head.version in digests, f"the head names version {head.head.version}, not in {versions}"
        assert head.head.manifest_digest == digests[head.head.version]
    return versions


def objects(url: str | Store, prefix: str = "") -> dict[str, bytes]:
    """Every object of a store under ``prefix``: key -> bytes."""
    store = open_store(url) if isinstance(url, str) else url
    return {info.key: store.get(info.key).data for info in store.list(prefix)}


class RecordingStore(WrapperStore):
    """Records every write that took effect, in order: ``(operation, key)``."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.writes: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        result = super().put_if_absent(key, data)
        with self._lock:
            self.writes.append(("put_if_absent", key))
        return result

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        result = super().put_if_match(key, data, etag)
        with self._lock:
            self.writes.append(("put_if_match", key))
        return result

    def delete(self, key: str) -> None:
        super().delete(key)
        with self._lock:
            self.writes.append(("delete", key))


class OutageStore(WrapperStore):
    """A store that is unreachable while ``down`` is set: every call raises StorageUnavailable."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.down = False
        self.calls_while_down = 0

    def _check(self) -> None:
        if self.down:
            self.calls_while_down += 1
            raise StorageUnavailable(f"{self.url}: unreachable (a test outage)")

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        self._check()
        return super().get(key, max_bytes=max_bytes)

    def get_if_changed(self, key: str, etag: str | None, *, max_bytes: int | None = None) -> ObjectData | None:
        self._check()
        return super().get_if_changed(key, etag, max_bytes=max_bytes)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self._check()
        return super().list(prefix, start_after=start_after)


def head_bytes(url: str | Store, run: str = "run") -> bytes:
    store = open_store(url) if isinstance(url, str) else url
    return store.get(f"{run}/{HEAD}").data
