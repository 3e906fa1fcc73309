"""Writing files that are then written through a shared map (a publisher's base), so
that the page cache holds them in 2 MiB folios.

Why: once the kernel writes a dirty page of a shared file map back, the page is
write-protected again and the next store into it faults. Scattered changes (0.4% of a
step's elements touch every 4 KiB page) then fault once per page: on this project's
ext4 VM (Linux 6.18) 0.25-0.35 s a GB of base per step, more than the scatter itself.
The page cache gives a ``write()`` folios as large as its length and offset allow, and
a 2 MiB folio at a 2 MiB offset is mapped by one page-table entry, faulting once for
its 512 pages (0.03 s a GB). So every write here starts on a 2 MiB boundary of the file
and covers whole 2 MiB, but the file's last; a kernel or file system without large
folios caches the same bytes in pages, as any write would.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Final

from bulletin.fileio import pwrite_all

__all__ = ["FOLIO_BYTES", "AlignedWriter", "copy_aligned"]

#: The folio each write covers whole: a PMD on x86-64 and arm64 with 4 KiB pages.
FOLIO_BYTES: Final = 2 << 20


class AlignedWriter:
    """Sequential writes to ``fd`` from byte ``offset`` on, issued as writes of whole
    :data:`FOLIO_BYTES` at their boundaries, through a buffer of one folio. The bytes
    always go through it: a write straight from memory that is not resident (a map of
    a checkpoint, the caller's) is copied by the kernel in ever smaller pieces, each in
    a smaller folio. :meth:`close` writes the rest; it does not close ``fd``.
    ``OSError`` passes through (the caller names the file)."""

    def __init__(self, fd: int, offset: int = 0) -> None:
        self._fd = fd
        self._at = offset  # the file offset of the buffer's first byte
        self._filled = 0
        self._buf = memoryview(bytearray(FOLIO_BYTES))

    @property
    def position(self) -> int:
        """The offset the next byte written goes to."""
        return self._at + self._filled

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            end = self._at + self._filled
            take = min(view.nbytes, FOLIO_BYTES - end % FOLIO_BYTES)
            self._buf[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if (end + take) % FOLIO_BYTES == 0:
                self._flush()

    def _flush(self) -> None:
        if self._filled:
            pwrite_all(self._fd, self._buf[: self._filled], self._at)
            self._at += self._filled
            self._filled = 0

    def close(self) -> None:
        """Write what the buffer holds (the file's end)."""
        self._flush()


#: Bytes per write of :func:`copy_aligned` (whole folios): a cancelled copy stops
#: within one of them.
COPY_STEP: Final = 8 * FOLIO_BYTES
#: ``madvise(MADV_POPULATE_READ)`` (Linux 5.14): Python 3.11's ``mmap`` does not name it.
_MADV_POPULATE_READ: Final = 22


def copy_aligned(src: int, dst: int, size: int, cancel: threading.Event | None = None) -> int:
    """Copy the first ``size`` bytes of file ``src`` to the same offsets of ``dst`` in
    whole folios (``copy_file_range`` writes a pipe's pages at a time, leaving ``dst`` in
    small folios), straight from a read-only map of ``src``: one copy, as the kernel's.
    Each step's pages are made resident first, or the kernel would copy them in ever
    smaller pieces. The bytes copied: fewer than ``size`` only when ``cancel`` was set."""
    have = os.fstat(src).st_size
    if have < size:
        raise OSError(f"file {src} holds {have} bytes, not the {size} to copy")
    if size <= 0:
        return 0
    with mmap.mmap(src, size, access=mmap.ACCESS_READ) as source:
        view = memoryview(source)
        try:
            done = 0
            while done < size:
                if cancel is not None and cancel.is_set():
                    break
                step = min(COPY_STEP, size - done)
                with contextlib.suppress(OSError):  # an older kernel: the same bytes, in smaller folios
                    source.madvise(_MADV_POPULATE_READ, done, step)
                pwrite_all(dst, view[done : done + step], done)
                done += step
            return done
        finally:
            view.release()
