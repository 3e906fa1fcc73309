"""In-process memory store (``memory://name``), for tests and single-process demos.

Every :class:`MemoryStore` opened with the same name in one process sees the same
objects, as two clients of one bucket would. ETags come from a process-wide counter,
so no ETag is ever handed out twice, even for identical bytes or after a delete.
"""

from __future__ import annotations

import builtins
import heapq
import itertools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from bulletin.errors import ConfigError, NotFound
from bulletin.storage.base import (
    Conflicted,
    Downloaded,
    ObjectData,
    ObjectInfo,
    StoreBase,
    Updated,
    WriteResult,
)
from bulletin.storage.files import CHUNK, FileSink, SourceFile, check_path, check_sha256
from bulletin.storage.keys import (
    check_data,
    check_etag,
    check_max_bytes,
    check_prefix,
    check_start_after,
    check_store_prefix,
    join_key,
    too_large,
)

__all__ = ["MemoryStore", "drop_memory_bucket"]

#: Objects per page that ``list`` copies out under the lock.
_PAGE: Final = 1000


@dataclass(frozen=True, slots=True)
class _Entry:
    data: bytes
    etag: str
    modified: datetime


@dataclass(slots=True)
class _Bucket:
    lock: threading.Lock = field(default_factory=threading.Lock)
    objects: dict[str, _Entry] = field(default_factory=dict)


_buckets: dict[str, _Bucket] = {}
_buckets_lock = threading.Lock()
_etags = itertools.count(1)


def _bucket(name: str) -> _Bucket:
    with _buckets_lock:
        bucket = _buckets.get(name)
        if bucket is None:
            bucket = _buckets[name] = _Bucket()
        return bucket


def drop_memory_bucket(name: str) -> None:
    """Forget every object of the memory bucket ``name`` (stores already open see it empty)."""
    bucket = _bucket(name)
    with bucket.lock:
        bucket.objects.clear()


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or any(ord(c) < 0x20 for c in name):
        raise ConfigError(f"memory store name must be a non-empty word without '/', got {name!r}")
    return name


class MemoryStore(StoreBase):
    """A dict behind a lock, shared by every store of the same ``name`` in this process."""

    __slots__ = ("_bucket", "_name", "_prefix")

    def __init__(self, name: str, prefix: str = "") -> None:
        self._name = _check_name(name)
        self._prefix = check_store_prefix(prefix)
        super().__init__(f"memory://{name}/{self._prefix}".rstrip("/"))
        self._bucket = _bucket(name)

    @property
    def name(self) -> str:
        """The name shared by every store of this bucket in the process."""
        return self._name

    @property
    def prefix(self) -> str:
        """The key prefix, ``""`` or ending in ``/``."""
        return self._prefix

    def _new_entry(self, data: bytes) -> _Entry:
        # Called under the bucket lock, which also orders the counter's values.
        return _Entry(data, f"m{next(_etags)}", datetime.now(UTC))

    def _entry(self, key: str) -> _Entry:
        self._check_open()
        full = join_key(self._prefix, key)
        with self._bucket.lock:
            entry = self._bucket.objects.get(full)
        if entry is None:
            raise NotFound(f"{self.url}: no object {key!r}")
        return entry

    def _read(self, key: str, etag: str | None, max_bytes: int | None) -> ObjectData | None:
        entry = self._entry(key)
        if etag is not None and entry.etag == etag:
            return None
        if max_bytes is not None and len(entry.data) > max_bytes:
            raise too_large(f"{self.url}: {key!r}", len(entry.data), max_bytes)
        return ObjectData(entry.data, entry.etag)

    def _read_range(self, key: str, start: int, stop: int) -> bytes:
        return bytes(self._entry(key).data[start:stop])

    def stat(self, key: str) -> ObjectInfo:
        """Size, ETag and modification time; ``NotFound`` if absent."""
        entry = self._entry(key)
        return ObjectInfo(key, len(entry.data), entry.etag, entry.modified)

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        """Create the object unless the key exists."""
        self._check_open()
        full = join_key(self._prefix, key)
        payload = check_data(data)
        with self._bucket.lock:
            current = self._bucket.objects.get(full)
            if current is not None:
                return Conflicted(current.etag)
            entry = self._bucket.objects[full] = self._new_entry(payload)
        return Updated(entry.etag)

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        """Create the object from a local file's bytes unless the key exists (the memory
        store holds every object whole, so the file is read whole)."""
        self._check_open()
        join_key(self._prefix, key)  # a bad key is refused before the file is read
        with SourceFile(path) as source:
            data = source.read_at(0, source.size)
        return self.put_if_absent(key, data)

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        """Write the object to ``path`` (temp file, SHA-256, fsync, rename)."""
        expected = check_sha256(sha256)
        bound = check_max_bytes(max_bytes)
        target = check_path(path)
        context = f"{self.url}: {key!r}"
        entry = self._entry(key)
        if bound is not None and len(entry.data) > bound:
            raise too_large(context, len(entry.data), bound)
        view = memoryview(entry.data)
        with FileSink(target, context=context, max_bytes=bound) as sink:
            for offset in range(0, len(view), CHUNK):
                sink.write(view[offset : offset + CHUNK])
            return sink.finish(entry.etag, sha256=expected)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        """Replace the object only while it carries ``etag``."""
        self._check_open()
        full = join_key(self._prefix, key)
        payload = check_data(data)
        check_etag(etag)
        with self._bucket.lock:
            current = self._bucket.objects.get(full)
            if current is None:
                return Conflicted(None)
            if current.etag != etag:
                return Conflicted(current.etag)
            entry = self._bucket.objects[full] = self._new_entry(payload)
        return Updated(entry.etag)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` after ``start_after``, in key order, a page at a time."""
        self._check_open()
        full_prefix = self._prefix + check_prefix(prefix)
        after = check_start_after(start_after)
        return self._list(full_prefix, None if after is None else self._prefix + after)

    def _list(self, full_prefix: str, full_after: str | None) -> Iterator[ObjectInfo]:
        cursor = full_after
        strip = len(self._prefix)
        while True:
            # Copy one page under the lock, like an S3 listing page: later pages see
            # writes made in between, as they would on a real bucket.
            with self._bucket.lock:
                keys = heapq.nsmallest(
                    _PAGE,
                    (k for k in self._bucket.objects if k.startswith(full_prefix) and (cursor is None or k > cursor)),
                )
                page: builtins.list[tuple[str, _Entry]] = [
                    (k, e) for k in keys if (e := self._bucket.objects.get(k)) is not None
                ]
            for full, entry in page:
                yield ObjectInfo(full[strip:], len(entry.data), entry.etag, entry.modified)
            if len(keys) < _PAGE:
                return
            cursor = keys[-1]

    def delete(self, key: str) -> None:
        """Remove the object; absent keys are fine."""
        self._check_open()
        full = join_key(self._prefix, key)
        with self._bucket.lock:
            self._bucket.objects.pop(full, None)
