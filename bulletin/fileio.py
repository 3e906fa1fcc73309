"""Crash-safe file writes (temp file, fsync, rename, fsync of the folder), and the one
place where the local file system's ``OSError`` becomes a typed error.

:func:`local_error` maps an ``OSError`` by its ``errno``: no space or quota left is
:class:`~bulletin.errors.DiskFull`, a read-only file system
:class:`~bulletin.errors.ReadOnlyStorage`, ``EACCES``/``EPERM``
:class:`~bulletin.errors.PermissionDenied`, anything else the branch they share,
:class:`~bulletin.errors.LocalStorageError`. The original stays the ``__cause__`` and
its ``errno`` is kept. Code that writes a node's files wraps them in
:func:`os_errors`; :func:`write_atomic` and :func:`atomic_file` do it themselves and
remove their temp file whatever fails.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Final

from bulletin.errors import (
    BulletinError,
    DiskFull,
    LocalStorageError,
    PermissionDenied,
    ReadOnlyStorage,
)

__all__ = ["atomic_file", "fsync_dir", "local_error", "os_errors", "pwrite_all", "stage_file", "write_atomic"]

_KINDS: Final[dict[int, type[LocalStorageError]]] = {
    errno.ENOSPC: DiskFull,
    errno.EDQUOT: DiskFull,
    errno.EROFS: ReadOnlyStorage,
    errno.EACCES: PermissionDenied,
    errno.EPERM: PermissionDenied,
}


def local_error(exc: OSError, what: str) -> LocalStorageError:
    """The typed, one-line error for ``exc`` met while doing ``what`` ("cannot write X")."""
    kind = _KINDS.get(exc.errno or 0, LocalStorageError)
    name = errno.errorcode.get(exc.errno or 0)
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = f" ({exc.filename})" if exc.filename is not None and str(exc.filename) not in what else ""
    error = kind(f"{what}{where}: {reason}" + (f" [{name}]" if name else ""))
    error.errno = exc.errno  # kept for callers that look (strerror stays None: str() is the message)
    return error


@contextmanager
def os_errors(what: str) -> Iterator[None]:
    """Raise any ``OSError`` of the block as :func:`local_error` (errors of the tree pass)."""
    try:
        yield
    except BulletinError:
        raise
    except OSError as exc:
        raise local_error(exc, what) from exc


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    with os_errors(f"cannot sync the folder {path}"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` of the open file ``fd`` (``os.pwrite`` may write less)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _tmp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


@contextmanager
def _temp_file(target: Path, *, fsync: bool = True) -> Iterator[tuple[BinaryIO, Path]]:
    """A new temp file beside ``target`` (``.NAME.tmp-PID``), fsynced when the block ends
    (unless ``fsync`` is false); removed if anything fails, the block included
    (``OSError`` as :func:`local_error`)."""
    tmp = _tmp_name(target)
    with os_errors(f"cannot write {target}"):
        try:
            with open(tmp, "wb") as fh:
                yield fh, tmp
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise


@contextmanager
def atomic_file(target: Path, *, sync_dir: bool = True, durable: bool = True) -> Iterator[BinaryIO]:
    """A file handle whose content replaces ``target`` when the block ends without error.

    The content goes to a temp file beside ``target`` (``.NAME.tmp-PID``), is fsynced,
    and renamed over ``target``: a crash leaves the old file or the new one, never a
    mix. If anything fails (the block included) the temp file is removed and ``target``
    is untouched; an ``OSError`` is raised as :func:`local_error`. ``durable=False``
    fsyncs nothing (neither the file nor its folder): the rename is still atomic for
    other processes and a crash of this one, not across a power loss.
    """
    sync_dir = sync_dir and durable
    with _temp_file(target, fsync=durable) as (fh, tmp):
        yield fh
    with os_errors(f"cannot write {target}"):
        try:
            os.replace(tmp, target)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
    if sync_dir:
        fsync_dir(target.parent)


def write_atomic(
    target: Path, parts: Iterable[bytes | memoryview], *, sync_dir: bool = True, durable: bool = True
) -> Path:
    """Write ``parts`` to ``target`` so that a crash leaves the old file or the new one
    (see :func:`atomic_file`: nothing is left behind on failure)."""
    with atomic_file(target, sync_dir=sync_dir, durable=durable) as fh:
        for part in parts:
            fh.write(part)
    return target


def stage_file(target: Path, parts: Iterable[bytes | memoryview]) -> Path:
    """Write ``parts`` to the temp file :func:`atomic_file` would use, fsynced, and return
    its path: the caller renames it over ``target`` at a commit point of its own (and
    removes it if it does not). Nothing is left behind on failure."""
    with _temp_file(target) as (fh, tmp):
        for part in parts:
            fh.write(part)
    return tmp
