"""Local directory store (a bare path or ``file:///abs/path``), the embedded default.

Keys map to files under the root (``a/b/c`` is ``<root>/a/b/c``). Conditional writes
are atomic on one machine and across processes, without check-then-write:

- create-only: the bytes go to a temporary file in the target's directory, which is
  fsynced and then hard-linked to the final name. ``link(2)`` fails if the name
  exists, so of any number of racing writers exactly one wins.
- compare-and-swap: under an exclusive ``flock`` (one of 256 lock files, picked by a
  hash of the key), the current ETag is compared, then a temporary file is
  fsynced and renamed over the target. Deletes take the same lock, so a delete
  never slips between a CAS's comparison and its rename.

Every write creates a new inode whose mtime is set to a fresh nanosecond timestamp
(strictly after the replaced file's, under the CAS lock), so the ETag derived from
``(st_ino, st_mtime_ns, st_size)`` changes with every write and never comes back.

Temporary and lock files start with ``.bulletin-``, a segment prefix that keys may
not use, and never appear in listings. Needs POSIX ``link``, ``rename`` and ``flock``
on a local file system; network file systems are not supported for concurrent
writers on several machines. Keys that would resolve outside the root (through a
symlink placed inside it) are refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat as stat_mod
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from bulletin.errors import (
    AccessDenied,
    BulletinError,
    ConfigError,
    InvalidInput,
    NotFound,
    StorageUnavailable,
)
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
    RESERVED_SEGMENT_PREFIX,
    check_data,
    check_etag,
    check_key,
    check_max_bytes,
    check_prefix,
    check_start_after,
    too_large,
)

__all__ = ["LocalStore"]

_LOCK_DIR: Final = RESERVED_SEGMENT_PREFIX + "locks"
_TMP_PREFIX: Final = RESERVED_SEGMENT_PREFIX + "tmp-"
_LOCK_STRIPES: Final = 256
#: A concurrent delete may remove an empty directory between our mkdir and our
#: temporary file; that many attempts make the race practically impossible to lose.
_CREATE_ATTEMPTS: Final = 8
_O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
_O_CREATE_NEW: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _modified(st: os.stat_result) -> datetime:
    return datetime.fromtimestamp(st.st_mtime_ns / 1e9, UTC)


def _listable_name(name: str) -> bool:
    """Whether a directory entry can be part of a key (others are not our objects)."""
    if name.startswith(RESERVED_SEGMENT_PREFIX) or name in {".", ".."} or "\\" in name:
        return False
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return False
    try:
        name.encode("utf-8")  # undecodable bytes arrive as lone surrogates
    except UnicodeEncodeError:
        return False
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _copy_file(source: SourceFile, fd: int) -> None:
    """All of ``source`` (its size at opening) into ``fd``, in the kernel where it can."""
    offset = 0
    try:
        while offset < source.size:
            copied = os.copy_file_range(source.fd, fd, source.size - offset, offset)
            if not copied:
                break
            offset += copied
    except OSError as exc:
        if exc.errno not in {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL} or offset:
            raise
        for chunk in source.chunks():  # no in-kernel copy between these file systems
            _write_all(fd, chunk)
        offset = source.size
    if offset != source.size:
        raise InvalidInput(f"{source.path} shrank while it was being sent (the file must not change)")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(StoreBase):
    """Objects as files in a directory tree; safe across threads and processes.

    The root directory is created on the first write. A path that exists and is not
    a directory raises ``ConfigError``.
    """

    __slots__ = ("_root",)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = os.path.abspath(os.fspath(root))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"local store root is not a directory: {path}")
        self._root = path
        super().__init__(Path(path).as_uri())

    @property
    def root(self) -> str:
        """The absolute path of the store's directory."""
        return self._root

    # -- paths and errors -------------------------------------------------------------

    def _path(self, key: str) -> tuple[str, str]:
        """``(parent directory, file path)`` of a checked key inside the root."""
        path = os.path.join(self._root, *check_key(key).split("/"))
        parent = os.path.dirname(path)
        real_root = os.path.realpath(self._root)
        real_parent = os.path.realpath(parent)
        if os.path.commonpath([real_root, real_parent]) != real_root:
            raise InvalidInput(f"{self.url}: key {key!r} resolves outside the store's root")
        return parent, path

    @contextlib.contextmanager
    def _os_errors(self, key: str) -> Iterator[None]:
        """Translate what the file system raises into the error tree, keeping the cause."""
        try:
            yield
        except BulletinError:
            raise
        except PermissionError as exc:
            raise AccessDenied(f"{self.url}: permission denied for {key!r}: {exc}") from exc
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                raise InvalidInput(f"{self.url}: key too long for the file system: {key!r}") from exc
            raise StorageUnavailable(f"{self.url}: {exc.strerror or exc} for {key!r}") from exc

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Hold the exclusive flock of the stripe that ``key`` hashes to."""
        stripe = hashlib.sha256(key.encode("utf-8")).digest()[0] % _LOCK_STRIPES
        lock_dir = os.path.join(self._root, _LOCK_DIR)
        os.makedirs(lock_dir, exist_ok=True)
        # flock (not POSIX record locks) because it excludes threads of one process
        # too: each call opens its own file description. Read-only suffices for
        # flock, so writers running as other users can share the lock files.
        path = os.path.join(lock_dir, f"{stripe:02x}")
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | _O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the last descriptor releases the lock

    # -- reads ------------------------------------------------------------------------

    def _open_object(self, key: str, path: str) -> int:
        """A read-only descriptor of the regular file ``path``; ``NotFound`` for anything else.

        Nothing but a regular file is opened for reading: ``lstat`` first (a directory
        is a prefix of other keys; a symlink, FIFO, socket or device is no object this
        store wrote), then ``O_NONBLOCK`` so that even a FIFO swapped in between cannot
        block the open, ``O_NOFOLLOW`` against a symlink swapped in, and ``fstat`` on the
        descriptor to be sure of what was opened.
        """
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{self.url}: no object {key!r}") from None
        if not stat_mod.S_ISREG(st.st_mode):
            raise NotFound(f"{self.url}: no object {key!r}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{self.url}: no object {key!r}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: not an object this store wrote
                raise NotFound(f"{self.url}: no object {key!r}") from None
            raise
        try:
            is_file = stat_mod.S_ISREG(os.fstat(fd).st_mode)
            if is_file:  # blocking reads again (regular files ignore the flag on Linux)
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        if not is_file:
            os.close(fd)
            raise NotFound(f"{self.url}: no object {key!r}")
        return fd

    def _read(self, key: str, if_changed_from: str | None, max_bytes: int | None) -> ObjectData | None:
        self._check_open()
        _, path = self._path(key)
        with self._os_errors(key):
            fd = self._open_object(key, path)
            # Files are never modified in place, so the descriptor's stat describes
            # exactly the bytes read through it.
            with open(fd, "rb", closefd=True) as f:
                st = os.fstat(fd)
                etag = _etag(st)
                if etag == if_changed_from:
                    return None
                if max_bytes is None:
                    return ObjectData(f.read(), etag)
                if st.st_size > max_bytes:
                    raise too_large(f"{self.url}: {key!r}", st.st_size, max_bytes)
                # One byte more than the size, so that a file grown since (not by this
                # store) is refused rather than cut short; never more than the bound.
                # (A buffered read of n bytes is one allocation, filled in a loop.)
                data = f.read(min(st.st_size, max_bytes) + 1)
                if len(data) > max_bytes:
                    raise too_large(f"{self.url}: {key!r}", None, max_bytes)
                return ObjectData(data, etag)

    def _read_range(self, key: str, start: int, stop: int) -> bytes:
        self._check_open()
        _, path = self._path(key)
        with self._os_errors(key):
            fd = self._open_object(key, path)
            try:
                chunks: list[bytes] = []
                at = start
                while at < stop and (chunk := os.pread(fd, stop - at, at)):
                    chunks.append(chunk)
                    at += len(chunk)
                return b"".join(chunks)
            finally:
                os.close(fd)

    def stat(self, key: str) -> ObjectInfo:
        """Size, ETag and modification time; ``NotFound`` if absent."""
        self._check_open()
        _, path = self._path(key)
        with self._os_errors(key):
            try:
                st = os.stat(path, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                raise NotFound(f"{self.url}: no object {key!r}") from None
            if not stat_mod.S_ISREG(st.st_mode):
                raise NotFound(f"{self.url}: no object {key!r}")
            return ObjectInfo(key, st.st_size, _etag(st), _modified(st))

    # -- writes -----------------------------------------------------------------------

    def _makedirs(self, parent: str, key: str) -> None:
        """Create ``parent`` and its missing ancestors, each made durable in its parent."""
        missing: list[str] = []
        path = parent
        while not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise InvalidInput(
                        f"{self.url}: key {key!r} needs a directory where an object is "
                        "stored (a local store cannot hold both 'a' and 'a/b')"
                    ) from None
                continue
            except NotADirectoryError:
                raise InvalidInput(
                    f"{self.url}: key {key!r} is below an existing object "
                    "(a local store cannot hold both 'a' and 'a/b')"
                ) from None
            _fsync_dir(os.path.dirname(directory))

    def _create_temp(self, parent: str, key: str) -> tuple[int, str]:
        """Open a new temporary file in ``parent`` (made if missing): ``(fd, path)``."""
        for _ in range(_CREATE_ATTEMPTS - 1):
            self._makedirs(parent, key)
            tmp = os.path.join(parent, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
            try:
                return os.open(tmp, _O_CREATE_NEW, 0o666), tmp
            except FileNotFoundError:
                continue  # a concurrent delete pruned the empty directory: make it again
        self._makedirs(parent, key)
        tmp = os.path.join(parent, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        return os.open(tmp, _O_CREATE_NEW, 0o666), tmp

    def _write_temp(self, parent: str, key: str, fill: Callable[[int], None], mtime_ns: int) -> tuple[str, str]:
        """A new fsynced temporary file in ``parent`` that ``fill(fd)`` wrote: ``(path, etag)``."""
        fd, tmp = self._create_temp(parent, key)
        try:
            fill(fd)
            # A fresh timestamp on a fresh inode: the new ETag differs from every
            # earlier one of this key, even for identical bytes.
            os.utime(fd, ns=(mtime_ns, mtime_ns))
            os.fsync(fd)
            etag = _etag(os.fstat(fd))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp, etag

    def _lost(self, key: str, path: str) -> Conflicted:
        """The key's name exists: the race is lost (or the key names a folder)."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:  # deleted since: it did exist when we lost
            return Conflicted(None)
        if stat_mod.S_ISDIR(st.st_mode):
            raise InvalidInput(
                f"{self.url}: key {key!r} is a directory of other objects "
                "(a local store cannot hold both 'a' and 'a/b')"
            ) from None
        return Conflicted(_etag(st))

    def _create(self, key: str, fill: Callable[[int], None]) -> WriteResult:
        """Create-only: a temp file that ``fill`` writes, hard-linked to the key's name."""
        parent, path = self._path(key)
        with self._os_errors(key):
            tmp, etag = self._write_temp(parent, key, fill, time.time_ns())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return self._lost(key, path)
            finally:
                os.unlink(tmp)
            _fsync_dir(parent)
        return Updated(etag)

    def _link_file(self, key: str, source: SourceFile) -> WriteResult | None:
        """``source`` itself as the object (``link=True``): fsynced, hard-linked
        create-only to the key's name, then given a fresh timestamp (a new ETag, as for a
        new inode; never touched where the race is lost: the file is another object then).
        None where the file systems differ or links are refused: the caller copies."""
        parent, path = self._path(key)
        with self._os_errors(key):
            os.fsync(source.fd)
            for _ in range(_CREATE_ATTEMPTS):
                self._makedirs(parent, key)
                try:
                    os.link(source.path, path)
                    break
                except FileExistsError:
                    return self._lost(key, path)
                except FileNotFoundError:
                    continue  # a concurrent delete pruned the empty directory: make it again
                except OSError as exc:
                    if exc.errno in {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP}:
                        return None
                    raise
            else:
                raise FileNotFoundError(errno.ENOENT, "the object's folder keeps disappearing", parent)
            now = time.time_ns()
            os.utime(source.fd, ns=(now, now))
            _fsync_dir(parent)
            if not os.path.samestat(os.fstat(source.fd), os.stat(path)):  # pragma: no cover
                raise InvalidInput(f"{source.path} was replaced while it was being linked")
            return Updated(_etag(os.fstat(source.fd)))

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        """Create the object unless the key exists (``link(2)`` decides the race)."""
        self._check_open()
        check_key(key)
        payload = check_data(data)
        return self._create(key, lambda fd: _write_all(fd, payload))

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        """Create the object from a local file unless the key exists: the file is copied in
        the kernel (``copy_file_range``) to a temp file, then linked as ``put_if_absent``;
        with ``link``, the file itself is linked where it lies on this file system (no
        bytes copied)."""
        self._check_open()
        check_key(key)
        with SourceFile(path) as source:
            if link:
                linked = self._link_file(key, source)
                if linked is not None:
                    return linked
            return self._create(key, lambda fd: _copy_file(source, fd))

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        """Copy the object to ``path``: in the kernel (``copy_file_range``) to a temp file,
        each chunk hashed (SHA-256) from the page cache while the next is copied, then
        fsync, verify, rename (through memory where the kernel cannot copy)."""
        self._check_open()
        _, source = self._path(key)
        expected = check_sha256(sha256)
        bound = check_max_bytes(max_bytes)
        target = check_path(path)
        context = f"{self.url}: {key!r}"
        with self._os_errors(key):
            fd = self._open_object(key, source)
        try:
            with self._os_errors(key):
                st = os.fstat(fd)
            if bound is not None and st.st_size > bound:
                raise too_large(context, st.st_size, bound)
            with FileSink(target, context=context, max_bytes=bound) as sink:
                # Objects are never changed in place: the descriptor's stat is these bytes'.
                if sink.copy_from(fd, st.st_size):
                    return sink.finish(_etag(st), sha256=expected, size=st.st_size)
                buffer = memoryview(bytearray(min(CHUNK, max(st.st_size, 1))))
                while True:
                    with self._os_errors(key):
                        n = os.readv(fd, [buffer])
                    if not n:
                        break
                    sink.write(buffer[:n])
                return sink.finish(_etag(st), sha256=expected)
        finally:
            os.close(fd)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        """Replace the object only while it carries ``etag`` (under the key's lock)."""
        self._check_open()
        parent, path = self._path(key)
        payload = check_data(data)
        check_etag(etag)
        with self._os_errors(key), self._key_lock(key):
            try:
                st = os.stat(path, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return Conflicted(None)
            if not stat_mod.S_ISREG(st.st_mode):
                return Conflicted(None)
            current = _etag(st)
            if current != etag:
                return Conflicted(current)
            # Strictly after the replaced file's mtime, even if the clock stepped back.
            mtime_ns = max(time.time_ns(), st.st_mtime_ns + 1)
            tmp, new_etag = self._write_temp(parent, key, lambda fd: _write_all(fd, payload), mtime_ns)
            try:
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(parent)
        return Updated(new_etag)

    def delete(self, key: str) -> None:
        """Remove the object (absent is fine), then prune directories left empty."""
        self._check_open()
        parent, path = self._path(key)
        if not os.path.lexists(path):
            return  # absent now: the delete takes effect here, no lock needed
        with self._os_errors(key):
            with self._key_lock(key):
                try:
                    os.unlink(path)
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    return
                _fsync_dir(parent)
            # Best effort: rmdir only succeeds on an empty directory, and a writer
            # whose directory vanishes under it makes it again.
            directory = parent
            while directory != self._root:
                try:
                    os.rmdir(directory)
                except OSError:
                    break
                directory = os.path.dirname(directory)

    # -- listing ----------------------------------------------------------------------

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` after ``start_after``, in key order, one directory at a time."""
        self._check_open()
        check_prefix(prefix)
        after = check_start_after(start_after)
        directory, _, partial = prefix.rpartition("/")
        start = os.path.join(self._root, *directory.split("/")) if directory else self._root
        real_root = os.path.realpath(self._root)
        if os.path.commonpath([real_root, os.path.realpath(start)]) != real_root:
            raise InvalidInput(f"{self.url}: prefix {prefix!r} resolves outside the store's root")
        return self._walk(start, directory + "/" if directory else "", partial, after)

    def _walk(self, path: str, key_base: str, name_prefix: str, after: str | None) -> Iterator[ObjectInfo]:
        with self._os_errors(key_base or "/"):
            try:
                with os.scandir(path) as it:
                    entries = [e for e in it if e.name.startswith(name_prefix) and _listable_name(e.name)]
            except (FileNotFoundError, NotADirectoryError):
                return
            # A directory sorts as "name/": every key below it starts so, which makes
            # a depth-first walk in this order yield keys in plain lexicographic order.
            items: list[tuple[str, os.DirEntry[str], bool]] = []
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        items.append((f"{key_base}{e.name}/", e, True))
                    elif e.is_file(follow_symlinks=False):
                        items.append((key_base + e.name, e, False))
                except FileNotFoundError:
                    continue
            items.sort(key=lambda item: item[0])
        for key, entry, is_dir in items:
            if is_dir:
                # Skip a subtree whose every key sorts before start_after.
                if after is not None and key < after and not after.startswith(key):
                    continue
                yield from self._walk(entry.path, key, "", after)
                continue
            if after is not None and key <= after:
                continue
            with self._os_errors(key):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted while we walked
                    continue
            yield ObjectInfo(key, st.st_size, _etag(st), _modified(st))
