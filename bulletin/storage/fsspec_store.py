"""Any fsspec filesystem as a store (``fsspec+<protocol>://...``, ``gs://``, ``https://``, ...).

Reads work through every filesystem; writes only where they are atomic on the server:

- :class:`FsspecStore` (here): any filesystem, **read-only**. fsspec's generic
  create-only write is a check-then-write (``AbstractFileSystem.pipe_file`` tests
  ``exists`` first, and so do the memory filesystem's ``open(mode="xb")`` and the
  local one's), and it has no compare-and-swap at all, so every write and delete is
  refused with ``StoreNotWritable`` before anything is sent.
- :class:`~bulletin.storage.fsspec_http.HttpStore`: ``http(s)://``, read-only, each read
  one GET (``If-None-Match`` on polls) through the filesystem's own aiohttp session.
- :class:`~bulletin.storage.fsspec_s3.S3fsStore`: ``fsspec+s3://``, read-write: the S3
  store's conditional requests sent through s3fs.

A read here is ``info`` (one metadata request on object stores) and then, unless the
object still carries the ETag asked about, a ranged ``cat_file`` of at most
``max_bytes + 1`` bytes. The ETag is the one the filesystem reports (``ETag`` / ``etag``
in ``info``: gcsfs, adlfs); where it reports none (memory, local, others) it is the
SHA-256 of the bytes read, so an idle poll there reads the whole object. ``info``
comes before the bytes, so an ETag is never newer than the bytes it is returned with:
a change in between costs one more read at the next poll, never a missed change.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from bulletin.errors import (
    AccessDenied,
    BulletinError,
    ConfigError,
    InvalidInput,
    NotFound,
    StorageUnavailable,
    StoreNotWritable,
)
from bulletin.storage.base import Downloaded, ObjectData, ObjectInfo, Store, StoreBase, WriteResult
from bulletin.storage.files import CHUNK, FileSink, check_path, check_sha256
from bulletin.storage.keys import check_key, check_max_bytes, check_prefix, check_start_after, too_large

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["DIGEST_ETAG_PREFIX", "FsspecStore", "content_etag", "fs_error", "listable_key", "open_fsspec"]

#: ETags this package makes from content start with this; a server's are quoted strings.
DIGEST_ETAG_PREFIX: Final = "sha256:"
#: Keys of an fsspec ``info`` dict that hold the object's version token, by filesystem.
_ETAG_FIELDS: Final = ("ETag", "etag")
#: Keys of an fsspec ``info`` dict that hold a modification time, by filesystem.
_TIME_FIELDS: Final = ("LastModified", "last_modified", "mtime", "updated", "created")


def content_etag(data: bytes) -> str:
    """The ETag of ``data`` where the filesystem gives none: its SHA-256."""
    return DIGEST_ETAG_PREFIX + hashlib.sha256(data).hexdigest()


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an fsspec backend's exception carries, if any (aiohttp's ``status``,
    gcsfs's ``code``, azure's ``status_code``)."""
    for name in ("status", "status_code", "code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def fs_error(exc: BaseException, context: str) -> BulletinError:
    """The :mod:`bulletin.errors` exception for what an fsspec filesystem raised (set ``from exc``).

    Missing paths (and directories where an object was asked for) are ``NotFound``;
    permission errors and HTTP ``401`` / ``403`` ``AccessDenied``; everything else
    (connection failures, timeouts, ``5xx``, a backend's own error types)
    ``StorageUnavailable``.
    """
    if isinstance(exc, BulletinError):
        return exc
    if isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return NotFound(f"{context}: no such object")
    status = _http_status(exc)
    if isinstance(exc, PermissionError) or status in {401, 403}:
        return AccessDenied(f"{context}: access denied ({type(exc).__name__}: {exc})")
    if status in {404, 410}:
        return NotFound(f"{context}: no such object")
    return StorageUnavailable(f"{context}: {type(exc).__name__}: {exc}")


def _modified(info: Mapping[str, Any]) -> datetime | None:
    """The modification time an ``info`` dict holds (a datetime, epoch seconds or ISO text)."""
    for name in _TIME_FIELDS:
        value = info.get(name)
        if isinstance(value, datetime):
            return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value, UTC)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
                return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return None


def _native_etag(info: Mapping[str, Any]) -> str | None:
    for name in _ETAG_FIELDS:
        value = info.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def listable_key(key: str) -> bool:
    """Whether a name found in a listing is a key (not a store's own file, not malformed)."""
    try:
        check_key(key)
    except InvalidInput:
        return False
    return True


class FsspecStore(StoreBase):
    """A read-only store over an fsspec filesystem, under the path ``root``.

    Keys map to ``<root>/<key>``. Safe to share between threads (fsspec's async
    filesystems run every call on their own event loop). Creating it sends nothing.
    """

    __slots__ = ("_fs", "_root")

    def __init__(self, fs: AbstractFileSystem, root: str, *, url: str | None = None) -> None:
        self._fs = fs
        self._root = root.rstrip("/")
        super().__init__(url if url is not None else "fsspec+" + str(fs.unstrip_protocol(self._root)))

    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem the objects are read through."""
        return self._fs

    @property
    def root(self) -> str:
        """The filesystem path keys are relative to (no trailing ``/``)."""
        return self._root

    @property
    def writable(self) -> bool:
        """False: fsspec gives no atomic create-only or compare-and-swap here."""
        return False

    # -- plumbing ---------------------------------------------------------------------

    def _path(self, key: str) -> str:
        checked = check_key(key)
        return f"{self._root}/{checked}" if self._root else checked

    def _key_of(self, path: str) -> str | None:
        """The key a path found in a listing stands for, or None if it is outside the root."""
        base = f"{self._root}/" if self._root else ""
        path = path.rstrip("/")
        return path[len(base) :] if path.startswith(base) and len(path) > len(base) else None

    @contextlib.contextmanager
    def _errors(self, context: str) -> Iterator[None]:
        """Translate what the filesystem raises into the error tree, keeping the cause."""
        try:
            yield
        except BulletinError:
            raise
        except Exception as exc:  # each backend has its own types: this is the boundary
            raise fs_error(exc, context) from exc

    def _where(self, key: str) -> str:
        return f"{self.url}: {key!r}"

    def _info(self, key: str) -> dict[str, Any]:
        """The filesystem's ``info`` of an object; ``NotFound`` for a directory or anything else."""
        with self._errors(self._where(key)):
            info = dict(self._fs.info(self._path(key)))
        if info.get("type") != "file":
            raise NotFound(f"{self._where(key)}: no such object")
        return info

    # -- reads ------------------------------------------------------------------------

    def _read(self, key: str, if_changed_from: str | None, max_bytes: int | None) -> ObjectData | None:
        self._check_open()
        info = self._info(key)
        etag = _native_etag(info)
        if etag is not None and etag == if_changed_from:
            return None
        size = info.get("size")
        if max_bytes is not None and isinstance(size, int) and size > max_bytes:
            raise too_large(self._where(key), size, max_bytes)
        with self._errors(self._where(key)):
            path = self._path(key)
            # One byte past the bound, so that an object grown since info is refused, not cut.
            raw = self._fs.cat_file(path) if max_bytes is None else self._fs.cat_file(path, start=0, end=max_bytes + 1)
        data = bytes(raw)
        if max_bytes is not None and len(data) > max_bytes:
            raise too_large(self._where(key), None, max_bytes)
        if etag is None:
            etag = content_etag(data)
            if etag == if_changed_from:
                return None
        return ObjectData(data, etag)

    def _read_range(self, key: str, start: int, stop: int) -> bytes:
        self._check_open()
        size = self._info(key).get("size")  # a directory is a prefix of keys, not an object
        if isinstance(size, int) and start >= size:
            return b""
        with self._errors(self._where(key)):
            return bytes(self._fs.cat_file(self._path(key), start=start, end=stop))

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        """Stream the object to ``path``: ``info`` (its size checked against ``max_bytes``),
        then the filesystem's file object read in chunks into a verified temp file. The
        ETag is the filesystem's, or else the SHA-256 of the bytes written."""
        self._check_open()
        expected = check_sha256(sha256)
        bound = check_max_bytes(max_bytes)
        target = check_path(path)
        context = self._where(key)
        info = self._info(key)
        size = info.get("size")
        known = size if isinstance(size, int) and not isinstance(size, bool) else None
        if bound is not None and known is not None and known > bound:
            raise too_large(context, known, bound)
        with FileSink(target, context=context, max_bytes=bound) as sink:
            with self._errors(context), self._fs.open(self._path(key), "rb", block_size=CHUNK) as source:
                while chunk := source.read(CHUNK):
                    sink.write(chunk)
            done = sink.finish(_native_etag(info) or "", sha256=expected, size=known)
        return done if done.etag else Downloaded(done.size, DIGEST_ETAG_PREFIX + done.sha256, done.sha256)

    def stat(self, key: str) -> ObjectInfo:
        """Size, ETag (None where the filesystem reports none) and modification time."""
        self._check_open()
        info = self._info(key)
        size = info.get("size")
        if not isinstance(size, int):
            raise StorageUnavailable(f"{self._where(key)}: the filesystem reports no size")
        return ObjectInfo(key, size, _native_etag(info), _modified(info))

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` after ``start_after`` in key order (one ``find``, then sorted)."""
        self._check_open()
        return self._list(check_prefix(prefix), check_start_after(start_after))

    def _list(self, prefix: str, after: str | None) -> Iterator[ObjectInfo]:
        directory = prefix.rpartition("/")[0]
        base = "/".join(p for p in (self._root, directory) if p)
        with self._errors(f"{self.url}: listing {prefix!r}"):
            try:
                found = self._fs.find(base, detail=True, withdirs=False)
            except FileNotFoundError:
                found = {}
        entries = []
        for path, info in found.items():
            key = self._key_of(path)
            if key is None or not key.startswith(prefix) or (after is not None and key <= after):
                continue
            if info.get("type") != "file" or not listable_key(key):
                continue
            size = info.get("size")
            if not isinstance(size, int):  # a listing without sizes: ask for this one
                entries.append(self.stat(key))
                continue
            entries.append(ObjectInfo(key, size, _native_etag(info), _modified(info)))
        entries.sort(key=lambda entry: entry.key)  # code point order is UTF-8 byte order
        yield from entries

    # -- writes: refused --------------------------------------------------------------

    def _refuse(self, operation: str, key: object) -> StoreNotWritable:
        return StoreNotWritable(
            f"{self.url}: {operation} {key!r} refused: this store is read-only (the filesystem has no "
            "atomic create-only or compare-and-swap write); publish to a writable store"
        )

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        """Refused: ``StoreNotWritable``, before anything is sent."""
        self._check_open()
        raise self._refuse("put_if_absent", key)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        """Refused: ``StoreNotWritable``, before anything is sent."""
        self._check_open()
        raise self._refuse("put_if_match", key)

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        """Refused: ``StoreNotWritable``, before anything is read or sent."""
        self._check_open()
        raise self._refuse("put_file_if_absent", key)

    def delete(self, key: str) -> None:
        """Refused: ``StoreNotWritable``, before anything is sent."""
        self._check_open()
        raise self._refuse("delete", key)


def open_fsspec(url: str, storage_options: Mapping[str, Any] | None = None, *, canonical: str | None = None) -> Store:
    """The store at an fsspec URL (``memory://bucket/run``, ``https://host/path``,
    ``s3://bucket/prefix``, ``gs://...``): the filesystem made with ``storage_options``
    on top of fsspec's own configuration (``FSSPEC_<PROTOCOL>`` JSON in the environment,
    files in ``FSSPEC_CONFIG_DIR``), never shared with other users of fsspec.

    ``s3`` goes to :class:`~bulletin.storage.fsspec_s3.S3fsStore` (read-write), ``http(s)``
    to :class:`~bulletin.storage.fsspec_http.HttpStore`, every other protocol to a
    read-only :class:`FsspecStore`. ``canonical`` is the store's URL (default:
    ``fsspec+`` and the URL). ``ConfigError`` when the protocol is unknown, its package is
    not installed, or the filesystem refuses the options. Sends no request, except
    where the filesystem connects as it is made (ftp, sftp: then ``StorageUnavailable``
    if it cannot).
    """
    from fsspec.core import url_to_fs

    # A filesystem of its own: fsspec would hand every opener of the same URL one cached
    # instance, and closing this store must not close anyone else's.
    options = {**(storage_options or {}), "skip_instance_cache": True}
    try:
        fs, path = url_to_fs(url, **options)
    except ImportError as exc:
        raise ConfigError(f"{url!r} needs a package that is not installed: {exc}") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"fsspec cannot open {url!r} with these options: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # a few filesystems (ftp, sftp) connect as they are made
        raise fs_error(exc, f"opening {url!r}") from exc
    name = canonical if canonical is not None else f"fsspec+{url.rstrip('/')}"
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if "s3" in protocols:
        from bulletin.storage.fsspec_s3 import S3fsStore

        bucket, _, prefix = str(path).partition("/")
        return S3fsStore(fs, bucket, prefix, url=name)
    if "http" in protocols or "https" in protocols:
        from bulletin.storage.fsspec_http import HttpStore

        return HttpStore(fs, str(path), url=name)
    return FsspecStore(fs, str(path), url=name)
