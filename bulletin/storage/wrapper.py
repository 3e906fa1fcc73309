"""Stores that wrap another store: a delegating base, one that counts traffic, one that
refuses writes.

:class:`WrapperStore` forwards every call of the :class:`~bulletin.storage.base.Store`
protocol to the store it wraps; a subclass overrides only the calls it observes or
changes (a benchmark counting bytes, a test injecting a delay, a fault or a crash).
:class:`CountingStore` counts requests and payload bytes both ways. :class:`ReadOnlyStore`
refuses every write with ``AccessDenied``, as a read-only S3 policy would: a reader's
store (a subscriber's, a mirror's origin) in a process that must never change it.
Modelled on zarr's ``WrapperStore`` and ``LoggingStore``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from bulletin.errors import AccessDenied
from bulletin.storage.base import Downloaded, ObjectData, ObjectInfo, Store, WriteResult
from bulletin.storage.keys import check_data

__all__ = ["CountingStore", "ReadOnlyStore", "Traffic", "WrapperStore"]


class WrapperStore:
    """A :class:`Store` that forwards every call to ``inner``; override what to observe."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        """The wrapped store's URL (opening it gives the store without the wrapper)."""
        return self.inner.url

    @property
    def writable(self) -> bool:
        """Whether the wrapped store takes writes."""
        return self.inner.writable

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        return self.inner.get(key, max_bytes=max_bytes)

    def get_if_changed(self, key: str, etag: str | None, *, max_bytes: int | None = None) -> ObjectData | None:
        return self.inner.get_if_changed(key, etag, max_bytes=max_bytes)

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        return self.inner.get_range(key, start, stop)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        return self.inner.put_if_absent(key, data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        return self.inner.put_if_match(key, data, etag)

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        return self.inner.put_file_if_absent(key, path, link=link)

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        return self.inner.get_to_file(key, path, sha256=sha256, max_bytes=max_bytes)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, start_after=start_after)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


@dataclass(frozen=True, slots=True)
class Traffic:
    """What went through a :class:`CountingStore` since it was last reset."""

    requests: int
    """Calls made, failed ones included (a listing counts once, however many pages it reads)."""
    up: int
    """Payload bytes written (object bodies only, no protocol overhead)."""
    down: int
    """Payload bytes read (object bodies only; an unchanged conditional read is 0)."""


class CountingStore(WrapperStore):
    """Counts requests and payload bytes both ways; safe to share between threads."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._requests = self._up = self._down = 0

    def _count(self, up: int = 0) -> None:
        with self._lock:
            self._requests += 1
            self._up += up

    def _received(self, obj: ObjectData | None) -> None:
        if obj is not None:
            with self._lock:
                self._down += len(obj.data)

    def reset(self) -> Traffic:
        """The counts so far, then start again from zero."""
        with self._lock:
            seen = Traffic(self._requests, self._up, self._down)
            self._requests = self._up = self._down = 0
        return seen

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        self._count()
        obj = super().get(key, max_bytes=max_bytes)
        self._received(obj)
        return obj

    def get_if_changed(self, key: str, etag: str | None, *, max_bytes: int | None = None) -> ObjectData | None:
        self._count()
        obj = super().get_if_changed(key, etag, max_bytes=max_bytes)
        self._received(obj)
        return obj

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        self._count()
        data = super().get_range(key, start, stop)
        with self._lock:
            self._down += len(data)
        return data

    def stat(self, key: str) -> ObjectInfo:
        self._count()
        return super().stat(key)

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        payload = check_data(data)  # not bytes: refused here, as the store would, uncounted
        self._count(up=len(payload))
        return super().put_if_absent(key, payload)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        payload = check_data(data)  # not bytes: refused here, as the store would, uncounted
        self._count(up=len(payload))
        return super().put_if_match(key, payload, etag)

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        try:
            size = os.stat(path).st_size
        except (OSError, TypeError, ValueError):
            size = 0  # the store refuses the path itself, with its typed error
        self._count(up=size)
        return super().put_file_if_absent(key, path, link=link)

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        self._count()
        result = super().get_to_file(key, path, sha256=sha256, max_bytes=max_bytes)
        with self._lock:
            self._down += result.size
        return result

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self._count()
        return super().list(prefix, start_after=start_after)

    def delete(self, key: str) -> None:
        self._count()
        super().delete(key)


class ReadOnlyStore(WrapperStore):
    """Reads pass through; every write (``put_if_absent``, ``put_if_match``, ``delete``) is
    refused with ``AccessDenied`` before it reaches the wrapped store, and counted in
    :attr:`refused` (thread-safe), so a test can assert that a reader never tried one.

    ``writable`` stays the wrapped store's: this stands for credentials without write
    permission, refused request by request as S3 answers ``403``, not for a store that
    cannot take writes at all (``StoreNotWritable``, refused up front)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._refused: list[str] = []

    @property
    def refused(self) -> tuple[str, ...]:
        """``"<operation> <key>"`` of every write refused so far, in order."""
        with self._lock:
            return tuple(self._refused)

    def _refuse(self, operation: str, key: str) -> AccessDenied:
        with self._lock:
            self._refused.append(f"{operation} {key}")
        return AccessDenied(f"{self.url}: {operation} {key!r} refused: this store is read-only")

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        raise self._refuse("put_if_absent", key)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        raise self._refuse("put_if_match", key)

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        raise self._refuse("put_file_if_absent", key)

    def delete(self, key: str) -> None:
        raise self._refuse("delete", key)
