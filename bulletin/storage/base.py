"""The storage protocol: bytes in, bytes out, with a version token (ETag).

Every object in a Bulletin bucket is immutable except the head pointer, so the
protocol needs only whole-object reads (bounded by ``max_bytes`` where the reader
knows how large the object may be) and writes, plus two conditional writes:

- ``put_if_absent`` (create-only, HTTP ``If-None-Match: *``): of any number of
  concurrent writers of one key, exactly one gets ``Updated``.
- ``put_if_match`` (compare-and-swap, HTTP ``If-Match: <etag>``): succeeds only
  while the object still carries ``etag``.

Objects too large to hold in memory (keyframe files of many GB) move between a store
and local files in bounded memory, streamed: ``put_file_if_absent`` (create-only, as
``put_if_absent``; S3 sends it as a multipart upload above the store's threshold) and
``get_to_file`` (the object written to a temp file beside the target, SHA-256 computed
as it streams, renamed into place only once complete and verified).

A lost race is an ordinary return value (``Conflicted``), never an exception.
Everything else that goes wrong is raised from :mod:`bulletin.errors`:
``NotFound`` for a missing key, ``InvalidInput`` for a bad key or argument,
``ObjectTooLarge`` for an object over a read's ``max_bytes``,
``AccessDenied`` / ``StorageUnavailable`` for the store itself, ``ConfigError``
for a bad URL, ``StoreNotWritable`` for a write to a store that is not ``writable``.
Backends translate their own exceptions at this boundary only.

ETags are opaque: compare them for equality, never parse them. A backend never
hands out the same ETag for two different contents of one key; two writes of
identical bytes may share one where the backend derives ETags from content (S3).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, Self, TypeAlias, runtime_checkable

from bulletin.errors import InvalidInput, StorageUnavailable, StoreNotWritable
from bulletin.storage.keys import check_etag, check_max_bytes, check_range

__all__ = [
    "Conflicted",
    "Downloaded",
    "ObjectData",
    "ObjectInfo",
    "Store",
    "StoreBase",
    "Updated",
    "WriteResult",
    "require_writable",
]


@dataclass(frozen=True, slots=True)
class ObjectData:
    """The bytes of an object and the ETag of exactly those bytes."""

    data: bytes
    etag: str

    def __repr__(self) -> str:  # Objects can be hundreds of MiB: never print them whole.
        return f"ObjectData(<{len(self.data)} bytes>, etag={self.etag!r})"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a listing or ``stat`` knows about an object, without its bytes."""

    key: str
    size: int
    etag: str | None
    last_modified: datetime | None


@dataclass(frozen=True, slots=True)
class Updated:
    """A conditional write took effect; ``etag`` is the new object's."""

    etag: str


@dataclass(frozen=True, slots=True)
class Conflicted:
    """A conditional write lost its race and changed nothing.

    ``current_etag`` is the ETag the key held when the loss was detected, or
    ``None`` when the key was absent (a compare-and-swap on a missing key).
    """

    current_etag: str | None


WriteResult: TypeAlias = Updated | Conflicted


@dataclass(frozen=True, slots=True)
class Downloaded:
    """What :meth:`Store.get_to_file` wrote: the object's size, its ETag, and the SHA-256
    (lowercase hex) of exactly the bytes now in the file."""

    size: int
    etag: str
    sha256: str


@runtime_checkable
class Store(Protocol):
    """An object store holding immutable blobs and a few compare-and-swap pointers.

    Keys are ``/``-separated relative paths (see :func:`bulletin.storage.keys.check_key`).
    Implementations are safe to share between threads.
    """

    @property
    def url(self) -> str:
        """The canonical URL that :func:`bulletin.storage.open_store` opens again.

        It never includes credentials.
        """
        ...

    @property
    def writable(self) -> bool:
        """Whether the store takes writes: create-only and compare-and-swap atomic where
        the objects live. ``False`` for a read-only store (an HTTP site, an fsspec
        filesystem without conditional writes), whose writes and deletes raise
        ``StoreNotWritable`` before sending anything; writers check it before any work
        (:func:`require_writable`).
        """
        ...

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        """The object's bytes and ETag; ``NotFound`` if absent.

        ``max_bytes`` bounds the read: an object larger than that is ``ObjectTooLarge``,
        found from its size before its bytes are read (the local store's ``fstat``, the
        ``Content-Length`` of S3's response), and a body that turns out longer while
        streaming in is refused once it passes the bound. In the local store only
        regular files are objects: anything else a key names (a directory, a FIFO, a
        device) is ``NotFound``, and is never opened in a way that could block.
        """
        ...

    def get_if_changed(self, key: str, etag: str | None, *, max_bytes: int | None = None) -> ObjectData | None:
        """Like :meth:`get`, but ``None`` while the object still carries ``etag``.

        On S3 an unchanged object costs one small ``304 Not Modified`` response.
        ``etag=None`` always reads. ``NotFound`` if absent; ``max_bytes`` as for
        :meth:`get` (an unchanged object is ``None`` whatever its size).
        """
        ...

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the object (``0 <= start < stop``, else
        ``InvalidInput``); ``NotFound`` if absent. As HTTP's ranges, a range past the
        object's end is cut there: fewer bytes, none when ``start`` is at or past it.

        Meant for immutable objects a reader needs part of (a rank's blocks of a
        keyframe file): no digest covers a range, so the reader checks what it read by
        what it knows of it (the blocks' fingerprints).
        """
        ...

    def stat(self, key: str) -> ObjectInfo:
        """Size, ETag and modification time of an object; ``NotFound`` if absent."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        """Create the object unless the key exists: atomic, exactly one winner."""
        ...

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        """Replace the object only while it carries ``etag`` (compare-and-swap).

        ``Conflicted`` when the object changed since ``etag`` was read, or is absent.
        """
        ...

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        """Create the object from the bytes of the local file ``path`` unless the key exists:
        :meth:`put_if_absent` for a file of any size, read in bounded memory.

        Atomic as ``put_if_absent`` (exactly one winner; readers never see part of it):
        the local store copies the file to a temp file and links it into place, S3 sends
        one ``PutObject`` up to the store's multipart threshold and a multipart upload
        above it (parts in parallel, each with its checksum, completed with
        ``If-None-Match: *``; aborted on any failure). A missing ``path``, or one that is
        not a regular file, is ``InvalidInput``; a file that shrinks while it is read
        is refused (``InvalidInput``) and nothing is created. The file must not change
        while it is sent.

        ``link``: the caller gives the file up to the store: it will never write to it
        again (it may read it, and remove its own name for it). A store on the local file
        system may then make the file itself the object, fsynced and hard-linked into
        place instead of copied (the local store does, on the same file system); every
        other store sends it as without.
        """
        ...

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        """Write the object to the local file ``path``, streamed in bounded memory.

        The bytes go to a temp file beside ``path`` (``.NAME.tmp-...``), hashed with
        SHA-256 as they arrive, fsynced, and renamed over ``path`` only once complete
        and, when ``sha256`` (lowercase hex) is given, verified: a mismatch is
        ``DigestMismatch``. ``max_bytes`` bounds the object as for :meth:`get`
        (``ObjectTooLarge``, from its size before its bytes where the store knows it).
        ``NotFound`` if absent. Whatever fails, nothing is left at ``path`` that was not
        there before (a file already there stays as it was) and the temp file is
        removed; the local disk's refusals are ``LocalStorageError`` kinds
        (``DiskFull``, ...). Meant for immutable objects: S3 reads the parts of one
        version (``If-Match`` on its ETag), and an object replaced meanwhile is
        ``StorageUnavailable``.
        """
        ...

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix`` and sorts after ``start_after``.

        Keys come in lexicographic order (of their UTF-8 bytes, as S3 sorts them),
        fetched lazily page by page.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove the object; deleting an absent key is not an error."""
        ...

    def close(self) -> None:
        """Release connections and handles. Idempotent; the store is unusable after."""
        ...


class StoreBase:
    """Plumbing shared by the built-in backends: the URL, closing, ``with`` support, and
    both reads over one hook, :meth:`_read`."""

    __slots__ = ("_closed", "_url")

    def __init__(self, url: str) -> None:
        self._url = url
        self._closed = False

    @property
    def url(self) -> str:
        """The canonical URL of this store; never includes credentials."""
        return self._url

    @property
    def writable(self) -> bool:
        """True: the built-in backends' conditional writes are atomic (read-only ones override)."""
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput(f"store {self._url} is closed")

    def close(self) -> None:
        """Release resources. Idempotent; any later call on the store raises ``InvalidInput``."""
        self._closed = True

    def _read(self, key: str, if_changed_from: str | None, max_bytes: int | None) -> ObjectData | None:
        """The backend's one read: the object (``NotFound`` if absent, ``ObjectTooLarge``
        over ``max_bytes``), or None while it still carries ``if_changed_from``; the
        arguments are already checked."""
        raise NotImplementedError

    def _read_range(self, key: str, start: int, stop: int) -> bytes:
        """The backend's ranged read (:meth:`Store.get_range`), the bounds already checked."""
        raise NotImplementedError

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the object, cut at its end; ``NotFound`` if absent."""
        self._check_open()
        first, end = check_range(start, stop)
        data = self._read_range(key, first, end)
        if len(data) > end - first:  # a server that ignored the range sent the whole object
            raise StorageUnavailable(f"{self._url}: {key!r}: {len(data)} bytes answered to a range of {end - first}")
        return data

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        """The object's bytes and ETag; ``NotFound`` if absent, ``ObjectTooLarge`` over ``max_bytes``."""
        data = self._read(key, None, check_max_bytes(max_bytes))
        if data is None:  # only a conditional read may answer "not modified"
            raise StorageUnavailable(f"{self._url}: {key!r}: 'not modified' answered to an unconditional read")
        return data

    def get_if_changed(self, key: str, etag: str | None, *, max_bytes: int | None = None) -> ObjectData | None:
        """The object unless it still carries ``etag`` (then ``None``); ``NotFound`` if absent."""
        return self._read(key, None if etag is None else check_etag(etag), check_max_bytes(max_bytes))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"


def require_writable(store: Store, action: str) -> None:
    """Raise ``StoreNotWritable`` unless ``store`` takes writes; ``action`` says what needed them.

    Writers call it before any work, so that a read-only store is refused before a
    model is diffed or a single object is uploaded or deleted.
    """
    if not store.writable:
        raise StoreNotWritable(
            f"{store.url} is read-only (no atomic conditional writes there): {action} needs a writable "
            "store (a local directory, s3://, fsspec+s3://)"
        )
