"""Files of the publisher's cache that a local store shares, made private before any write.

A keyframe is written once, into the publisher's cache folder, and a local store on the
same file system takes its files as they are (``put_file_if_absent(..., link=True)``:
a hard link, no bytes copied). The store's objects must never change, and the cache is
advanced in place by every later version, so a cache file with other links is mapped
read only (a write through it fails) until :func:`make_private` has replaced it by a
copy of its own: the bytes copied to a temp file beside it in whole 2 MiB folios
(:func:`~bulletin.aligned_writes.copy_aligned`), renamed over its name, while the
store's name keeps the old inode. :class:`Privatizer` does that on a thread of its own
right after the keyframe's commit, so that the copy overlaps what the trainer does next
instead of lengthening the publish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Final

from bulletin.aligned_writes import copy_aligned
from bulletin.fileio import os_errors

__all__ = ["Privatizer", "make_private", "remove_temps", "shared_files"]

log = logging.getLogger("bulletin.shared_files")

_TEMP_MARK: Final = ".private-"


def shared_files(folder: Path) -> list[Path]:
    """The regular files of ``folder`` that have other names (hard links) too."""
    out = []
    # Closed even when a file goes mid-scan (the cache's folder swept under a background copy).
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False) and _TEMP_MARK not in entry.name and entry.stat().st_nlink > 1:
                out.append(Path(entry.path))
    return sorted(out)


def remove_temps(folder: Path) -> None:
    """Temp files of a copy a killed process left in ``folder``."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith(".") and _TEMP_MARK in entry.name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def make_private(path: Path, cancel: threading.Event | None = None) -> bool:
    """Give ``path`` an inode of its own with the same bytes, copied in whole folios (the
    other names keep the old one): a file a store shares becomes private, and one
    written in pieces (a download, ranged reads) is laid out for writes through a map.
    False if ``cancel`` was set first: nothing changed, no temp file left."""
    tmp = path.with_name(f".{path.name}{_TEMP_MARK}{secrets.token_hex(4)}")
    with os_errors(f"cannot copy {path}"):
        src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(src).st_size
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                # Whole folios at their offsets: the base's map faults once per 2 MiB.
                done = copy_aligned(src, dst, size, cancel)
            finally:
                os.close(dst)
            if done < size:
                os.unlink(tmp)
                return False
            # Not fsynced: the cache is verified by fingerprints whenever it is opened.
            os.replace(tmp, path)
            return True
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(src)


class Privatizer:
    """:func:`make_private` of every shared file of ``folder``, on a thread of its own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bulletin-private-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for path in shared_files(self.folder):
                if not make_private(path, self._cancel):
                    return
        except Exception as exc:  # the caller copies what is left itself, raising then
            self.error = exc
            log.warning("%s: a private copy of the cache failed (%s); the next write makes it", self.folder, exc)

    def join(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        """Cancel (within one step of the copy) and wait."""
        self._cancel.set()
        self._thread.join()
