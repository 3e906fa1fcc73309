"""A keyframe written into a new folder of a publisher's cache (:class:`StagedKeyframe`),
each file's SHA-256 computed as it is written, uploaded from those files, and the base
of the next diff once its version is committed (:meth:`~bulletin.base.PublishedBase.advance`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.aligned_writes import AlignedWriter
from bulletin.blocks import Block
from bulletin.checkpoint import INDEX_NAME, encode_safetensors_header, hf_index, plan_checkpoint
from bulletin.errors import InternalError
from bulletin.fileio import os_errors
from patcher.patch import TensorSpec

__all__ = ["KeyframeFile", "StagedKeyframe"]


@dataclass(frozen=True, slots=True)
class KeyframeFile:
    """One file of a staged keyframe, as written: its name, path, size and SHA-256."""

    name: str
    path: Path
    size: int
    sha256: str


#: Writes at least this large are hashed on another thread while they are written.
_HASH_APART_BYTES: Final = 1 << 20


@dataclass(slots=True)
class _Open:
    """The file being written: written in whole folios (the folder may become the
    base, written through a map at every version: :mod:`bulletin.aligned_writes`)."""

    path: Path
    fd: int
    writer: AlignedWriter
    digest: Any
    index: int


class StagedKeyframe:
    """A keyframe being written into a new folder of the cache, tensor by tensor in name
    order (the order of :func:`~bulletin.checkpoint.plan_checkpoint`), each file's
    SHA-256 computed as it is written. The bytes are exactly
    :func:`~bulletin.checkpoint.safetensors_bytes`'. Uploaded from the files (each data
    file handed to ``on_file`` once it is closed, for an upload to start while the next
    is written); once its version is committed the folder becomes the base
    (:meth:`~bulletin.base.PublishedBase.advance`).

    ``blocks``: the part of each tensor written, when the folder holds blocks of the
    version's tensors (a rank's, :mod:`bulletin.blocks`; ``specs`` are then the blocks'
    shapes), not whole ones. ``hashed=False`` skips the SHA-256 of files that are never
    uploaded."""

    def __init__(
        self,
        folder: Path,
        specs: Mapping[str, TensorSpec],
        file_bytes: int,
        *,
        blocks: Mapping[str, Block] | None = None,
        hashed: bool = True,
    ) -> None:
        self.folder = folder
        self.on_file: Callable[[KeyframeFile], None] | None = None
        self.specs = dict(specs)
        self.blocks = dict(blocks) if blocks is not None else {s.name: Block.whole(s.shape) for s in specs.values()}
        if any(self.blocks[name].sizes != spec.shape for name, spec in self.specs.items()):
            raise InternalError("a staged keyframe's blocks are not its tensors' shapes")
        self._hashed = hashed
        self._plan = plan_checkpoint(specs, file_bytes)
        self._order = [(i, spec) for i, (_, shard) in enumerate(self._plan) for spec in shard]
        self._next = 0
        self._open: _Open | None = None
        self.files: list[KeyframeFile] = []
        # Each tensor's bytes are hashed on this thread while the caller's writes them.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bulletin-keyframe-sha256")
        with os_errors(f"cannot create {folder}"):
            folder.mkdir(parents=True)

    def write(self, name: str, bits: NDArray[Any]) -> None:
        """Append tensor ``name`` (the next one in name order) with ``bits``."""
        if self._next >= len(self._order) or self._order[self._next][1].name != name:
            raise InternalError(f"keyframe tensors written out of order at {name!r}")
        index, spec = self._order[self._next]
        data = np.ascontiguousarray(bits).reshape(-1).view(np.uint8)
        if data.size != spec.nbytes:
            raise InternalError(f"{name}: {data.size} bytes for a tensor of {spec.nbytes}")
        if self._open is None or self._open.index != index:
            self._close_file()
            self._open_file(index)
        self._put(data.data)
        self._next += 1

    def _open_file(self, index: int) -> None:
        file_name, shard = self._plan[index]
        header, _ = encode_safetensors_header(shard, {"format": "pt"})
        path = self.folder / file_name
        with os_errors(f"cannot write {path}"):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._open = _Open(path, fd, AlignedWriter(fd), hashlib.sha256(), index)
        self._put(header)

    def _put(self, data: bytes | memoryview) -> None:
        if self._open is None:  # pragma: no cover - write() opens the file first
            raise InternalError("keyframe bytes written with no file open")
        out = self._open
        # Both release the GIL: the hash of these bytes overlaps their write, and is
        # done when this returns (the caller may drop or change them then).
        apart = self._hashed and len(data) >= _HASH_APART_BYTES
        hashing = self._hasher.submit(out.digest.update, data) if apart else None
        try:
            with os_errors(f"cannot write {out.path}"):
                out.writer.write(data)
        finally:
            if hashing is not None:
                hashing.result()
        if self._hashed and hashing is None:
            out.digest.update(data)

    def _close_file(self) -> None:
        if self._open is None:
            return
        out = self._open
        self._open = None
        try:
            with os_errors(f"cannot write {out.path}"):
                out.writer.close()
                size = out.writer.position
        finally:
            os.close(out.fd)
        sha256 = out.digest.hexdigest() if self._hashed else ""  # never uploaded: nothing to name
        done = KeyframeFile(self._plan[out.index][0], out.path, size, sha256)
        self.files.append(done)
        if self.on_file is not None:
            self.on_file(done)

    def finish(self) -> list[KeyframeFile]:
        """Close the last file, write the index of a split keyframe; the files to upload."""
        if self._next != len(self._order):
            raise InternalError(f"keyframe finished after {self._next} of {len(self._order)} tensors")
        if not self._order:  # nothing held (a rank that owns no block): a file of no tensors
            self._open_file(0)
        self._close_file()
        if len(self._plan) > 1:
            index = hf_index(self._plan)
            path = self.folder / INDEX_NAME
            with os_errors(f"cannot write {path}"):
                path.write_bytes(index)
            self.files.append(KeyframeFile(INDEX_NAME, path, len(index), hashlib.sha256(index).hexdigest()))
        self._hasher.shutdown()
        return list(self.files)

    def discard(self) -> None:
        if self._open is not None:
            with contextlib.suppress(OSError):
                os.close(self._open.fd)
            self._open = None
        self._hasher.shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)
