"""Streaming between a store and local files: the pieces every store's
``put_file_if_absent`` and ``get_to_file`` share.

- :class:`SourceFile`: a local regular file opened for sending, read by offset
  (``pread``, so parallel parts need no shared position) or in chunks; :class:`FileRange`
  is one part of it as a seekable file object, which an HTTP client streams from the
  page cache instead of holding the part in memory.
- :class:`FileSink`: where a download goes: a temp file beside the target, the SHA-256
  computed in order (also when parallel ranged reads write it out of order: then read
  back from the temp file's page cache, so no part waits in memory to be hashed), the
  read bound enforced, and the file fsynced, verified and renamed into place by
  :meth:`FileSink.finish` only. Whatever fails before, the temp file is removed and the
  target is untouched. :meth:`FileSink.copy_from` copies a local file in the kernel
  while the bytes already copied are hashed.
- :func:`run_window`: parallel tasks with at most ``window`` results held at once,
  consumed in order on the calling thread: memory stays O(part size x window).

The local disk's refusals (the target's folder, the source file) are translated by
:func:`bulletin.fileio.local_error` (``DiskFull``, ``ReadOnlyStorage``, ...), as for the
node's other files; the store's own failures stay the store's.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import os
import re
import stat as stat_mod
import sys
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from contextlib import suppress
from pathlib import Path
from typing import Any, Final, Self, TypeVar, cast

from bulletin.errors import BulletinError, DigestMismatch, InvalidInput, StorageUnavailable
from bulletin.fileio import fsync_dir, local_error, os_errors
from bulletin.storage.base import Downloaded
from bulletin.storage.keys import too_large

__all__ = [
    "CHUNK",
    "FileRange",
    "FileSink",
    "SourceFailed",
    "SourceFile",
    "check_path",
    "check_sha256",
    "raise_source_failure",
    "run_window",
    "start_writeback",
]

#: Bytes per sequential read or write of a streamed transfer.
CHUNK: Final = 8 << 20
#: Bytes per in-kernel copy of :meth:`FileSink.copy_from`, hashed while the next one runs.
_COPY_CHUNK: Final = 16 << 20
#: ``copy_file_range`` refusals that mean "not between these files": copy through memory.
_NO_KERNEL_COPY: Final = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
#: Below this, a chunk is hashed and written on one thread (a hand-off costs more).
_PARALLEL_WRITE: Final = 1 << 20
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)

_T = TypeVar("_T")


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None: Python's ``os`` does not expose it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], function)


_SYNC_FILE_RANGE: Final = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE: Final = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk now,
    without waiting (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux): the final
    ``fsync`` then finds little left to write, instead of the whole file. A hint only:
    durability still comes from that ``fsync``; a failure or another OS does nothing."""
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def check_sha256(value: object) -> str | None:
    """``value`` if it is None or a lowercase hex SHA-256 (as manifests record them)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _SHA256_RE.fullmatch(value):
        raise InvalidInput(f"sha256 must be 64 lowercase hex digits, got {value!r}")
    return value


def check_path(path: object) -> Path:
    """A local path argument (``str`` or ``os.PathLike``) as a ``Path``."""
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
        raise InvalidInput(f"path must be a str or os.PathLike, got {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\x00" in text:
        raise InvalidInput(f"not a usable file path: {path!r}")
    return Path(text)


class SourceFile:
    """A local regular file opened for sending; its size is the one seen at opening.

    ``InvalidInput`` when the path is missing or not a regular file; other refusals of
    the disk are ``LocalStorageError`` kinds. Reads shorter than that size (the file was
    cut meanwhile) are ``InvalidInput``: nothing half-read is ever sent as complete.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = check_path(path)
        what = f"cannot read {self.path}"
        try:
            fd = os.open(self.path, os.O_RDONLY | _O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise InvalidInput(f"no file to send at {self.path}") from None
        except OSError as exc:
            raise local_error(exc, what) from exc
        try:
            with os_errors(what):
                st = os.fstat(fd)
            if not stat_mod.S_ISREG(st.st_mode):
                raise InvalidInput(f"not a regular file: {self.path}")
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = st.st_size

    def read_at(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset`` (thread-safe: ``pread``)."""
        with os_errors(f"cannot read {self.path}"):
            data = os.pread(self.fd, length, offset)
            if len(data) < length:  # pread may return short before EOF, rarely
                pieces = [data]
                got = len(data)
                while got < length:
                    more = os.pread(self.fd, length - got, offset + got)
                    if not more:
                        break
                    pieces.append(more)
                    got += len(more)
                data = b"".join(pieces)
        if len(data) != length:
            raise InvalidInput(f"{self.path} shrank while it was being sent (the file must not change)")
        return data

    def chunks(self, size: int = CHUNK) -> Iterator[bytes]:
        """The whole file (its size at opening) in chunks of at most ``size`` bytes."""
        for offset in range(0, self.size, size):
            yield self.read_at(offset, min(size, self.size - offset))

    def close(self) -> None:
        """Close the descriptor. Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SourceFailed(Exception):
    """Raised by :meth:`FileRange.read` when the local file fails under an HTTP client.

    Not an ``OSError``, so that urllib3 and botocore do not take a local read error for
    a broken connection (and send the part again); the real error is :attr:`error`.
    """

    def __init__(self, error: BulletinError) -> None:
        super().__init__(str(error))
        self.error = error


class FileRange(io.RawIOBase):
    """``length`` bytes of ``source`` from ``offset`` as a seekable, read-only file object.

    An HTTP client streams a request body from it (one small read at a time, from the
    page cache), so a part in flight costs no memory of its own; it seeks back to send
    the part again. A failing or shrunk source raises :class:`SourceFailed`, whose
    ``error`` is the ``LocalStorageError`` or ``InvalidInput`` (also kept in
    :attr:`failure`, in case a client wraps the exception).
    """

    def __init__(self, source: SourceFile, offset: int, length: int) -> None:
        super().__init__()
        self._source = source
        self._offset = offset
        self._length = length
        self._pos = 0
        self.failure: BulletinError | None = None

    def __len__(self) -> int:
        return self._length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        left = self._length - self._pos
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        try:
            data = self._source.read_at(self._offset + self._pos, n)
        except BulletinError as exc:
            self.failure = exc
            raise SourceFailed(exc) from exc
        self._pos += n
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def crc32(self, chunk: int = 1 << 20) -> int:
        """CRC-32 of the whole range (read in ``chunk`` bytes); the position is kept."""
        position, self._pos = self._pos, 0
        crc = 0
        try:
            while data := self.read(chunk):
                crc = zlib.crc32(data, crc)
        finally:
            self._pos = position
        return crc


def raise_source_failure(body: object, exc: BaseException) -> None:
    """Raise the local file's own error if ``exc`` ended a send of ``body`` (a
    :class:`FileRange`) because the file failed; otherwise return."""
    failure = body.failure if isinstance(body, FileRange) else None
    if failure is not None:
        raise failure from exc


class FileSink:
    """The temp file a download streams into, beside ``target``; use it in a ``with`` block.

    Sequential writers call :meth:`write`; parallel ranged readers call :meth:`write_at`
    from any thread and :meth:`absorb` (the bytes written, read back and hashed) or
    :meth:`update` (bytes in hand) in order on one. :meth:`finish` makes the result
    durable and visible; leaving the block without it (an exception included) removes
    the temp file. ``max_bytes`` refuses a body that streams in longer than the bound.
    """

    def __init__(self, target: str | os.PathLike[str], *, context: str, max_bytes: int | None = None) -> None:
        self.target = check_path(target)
        self.context = context
        self.max_bytes = max_bytes
        self.size = 0
        self._hash = hashlib.sha256()
        self._tmp = self.target.with_name(f".{self.target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._fd = -1
        self._writer: ThreadPoolExecutor | None = None
        self._readback: memoryview | None = None
        self._done = False

    def __enter__(self) -> Self:
        with os_errors(f"cannot write {self.target}"):
            # Read-write: :meth:`absorb` hashes what parallel writers put there.
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close()
        if not self._done:
            with suppress(OSError):
                os.unlink(self._tmp)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _count(self, n: int) -> None:
        self.size += n
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise too_large(self.context, None, self.max_bytes)

    def update(self, data: bytes | memoryview) -> None:
        """Hash the next bytes of the object (in order) and count them against the bound."""
        self._count(len(data))
        self._hash.update(data)

    def absorb(self, length: int) -> None:
        """Hash (and count) the next ``length`` bytes, already written at their offsets by
        :meth:`write_at` or :meth:`copy_from`: read back from the temp file in chunks of
        :data:`CHUNK` into one reused buffer (the page cache holds them; memory does not)."""
        offset = self.size
        end = offset + length
        self._count(length)
        if self._readback is None:
            self._readback = memoryview(bytearray(min(CHUNK, max(length, 1))))
        buffer = self._readback
        with os_errors(f"cannot read back {self._tmp}"):
            while offset < end:
                n = os.preadv(self._fd, [buffer[: min(len(buffer), end - offset)]], offset)
                if not n:
                    raise StorageUnavailable(f"{self.context}: the temp file {self._tmp} ended at {offset} bytes")
                self._hash.update(buffer[:n])
                offset += n

    def copy_from(self, fd: int, size: int) -> bool:
        """Append ``size`` bytes of the file ``fd`` (from its start) by in-kernel copies
        (``copy_file_range``, no bytes through this process), each chunk hashed from the
        page cache while the next one is copied (two threads, both without the GIL).

        False, with nothing written, when the kernel cannot copy between these two files
        (another file system on an old kernel, a file system without it): then copy
        through memory with :meth:`write`. A source shorter than ``size`` stops the copy
        early (``finish`` with ``size`` refuses the result).
        """
        what = f"cannot copy to {self.target}"
        start = self.size

        def copy(index: int) -> int:
            offset = index * _COPY_CHUNK
            want = min(_COPY_CHUNK, size - offset)
            done = 0
            with os_errors(what):
                while done < want:
                    at = offset + done
                    copied = os.copy_file_range(fd, self._fd, want - done, at, start + at)
                    if not copied:
                        break
                    done += copied
            start_writeback(self._fd, start + offset, done)
            return done

        count = -(-size // _COPY_CHUNK)
        try:
            first = copy(0) if count else 0
        except OSError as exc:
            if exc.errno in _NO_KERNEL_COPY:
                return False
            raise
        self.absorb(first)
        if count <= 1 or first < _COPY_CHUNK:
            return True
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bulletin-sink")
        short = False

        def consume(_: int, copied: int) -> None:
            nonlocal short
            if not short:
                self.absorb(copied)
            short = short or copied < _COPY_CHUNK

        # One chunk copied ahead of the one being hashed: memory is the read-back buffer.
        run_window(self._writer, count - 1, lambda i: copy(i + 1), 2, consume)
        return True

    def written(self, offset: int, length: int) -> None:
        """Bytes ``offset .. offset + length`` are all written: start their writeback."""
        start_writeback(self._fd, offset, length)

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write ``data`` at ``offset`` of the temp file (thread-safe; hashes nothing)."""
        view = memoryview(data)
        with os_errors(f"cannot write {self.target}"):
            while view:
                written = os.pwrite(self._fd, view, offset)
                view = view[written:]
                offset += written

    def write(self, data: bytes | memoryview) -> None:
        """Append the next bytes: hashed, counted and written (the hash and the write of
        a large chunk run at once, on two threads: both release the GIL)."""
        offset = self.size
        self._count(len(data))
        if len(data) < _PARALLEL_WRITE:
            self._hash.update(data)
            self.write_at(offset, data)
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bulletin-sink")
        pending = self._writer.submit(self.write_at, offset, data)
        try:
            self._hash.update(data)
        finally:
            pending.result()

    def reset(self) -> None:
        """Start again from an empty file (a download restarted from its first byte)."""
        with os_errors(f"cannot write {self.target}"):
            os.ftruncate(self._fd, 0)
        self.size = 0
        self._hash = hashlib.sha256()

    def finish(self, etag: str, *, sha256: str | None = None, size: int | None = None) -> Downloaded:
        """Check the size and digest, fsync, rename over the target, fsync its folder.

        ``size`` is the length the store promised (a short body is ``StorageUnavailable``
        from the caller's point of view: the transfer broke); ``sha256`` the digest
        expected (``DigestMismatch``, nothing renamed).
        """
        if size is not None and self.size != size:
            raise StorageUnavailable(f"{self.context}: {self.size} bytes arrived of the {size} announced")
        digest = self._hash.hexdigest()
        if sha256 is not None and digest != sha256:
            raise DigestMismatch(f"{self.context}: SHA-256 {digest} where {sha256} was expected; nothing was kept")
        what = f"cannot write {self.target}"
        with os_errors(what):
            os.fsync(self._fd)
        self._close()
        with os_errors(what):
            os.replace(self._tmp, self.target)
        self._done = True
        fsync_dir(self.target.parent)
        return Downloaded(self.size, etag, digest)


def run_window(
    pool: Executor,
    count: int,
    task: Callable[[int], _T],
    window: int,
    consume: Callable[[int, _T], None],
) -> None:
    """Run ``task(0) .. task(count - 1)`` on ``pool``, at most ``window`` of them submitted
    and not yet consumed; ``consume(i, result)`` runs on this thread in index order.

    The first failure (of a task or of ``consume``) cancels the tasks not started, waits
    for the running ones (they may hold buffers and descriptors), and is raised.
    """
    futures: dict[int, Future[_T]] = {}
    submitted = 0
    try:
        for index in range(count):
            while submitted < count and submitted < index + window:
                futures[submitted] = pool.submit(task, submitted)
                submitted += 1
            consume(index, futures.pop(index).result())
    except BaseException:
        for future in futures.values():
            future.cancel()
        wait(futures.values())
        raise
