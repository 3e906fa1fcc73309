"""Crash-safe file writes: temp file, fsync, rename, fsync of the folder."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic"]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, parts: Iterable[bytes | memoryview], *, sync_dir: bool = True) -> Path:
    """Write ``parts`` to ``target`` so that a crash leaves the old file or the new one."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        for part in parts:
            fh.write(part)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    if sync_dir:
        fsync_dir(target.parent)
    return target
