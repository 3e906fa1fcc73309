"""bulletin.aligned_writes: the bytes land where they were written, and every write the
kernel sees starts on a folio boundary and covers whole folios (the file's end aside),
which is what lets the page cache hold a publisher's base in 2 MiB folios."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from bulletin import aligned_writes
from bulletin.aligned_writes import FOLIO_BYTES, AlignedWriter, copy_aligned
from bulletin.fileio import pwrite_all
from bulletin.keyframe_stage import StagedKeyframe
from bulletin.shared_files import make_private
from patcher.patch import TensorSpec


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each (offset, length) handed to the kernel, in order (the real writes still run)."""
    seen: list[tuple[int, int]] = []
    real = pwrite_all

    def recorded(fd: int, data: bytes | memoryview, offset: int) -> None:
        seen.append((offset, memoryview(data).nbytes))
        real(fd, data, offset)

    monkeypatch.setattr(aligned_writes, "pwrite_all", recorded)
    return seen


def _check_folios(seen: list[tuple[int, int]], start: int, size: int) -> None:
    """Contiguous from ``start``; each write on a boundary (the first may start where
    the writer did) and of whole folios, but the last."""
    at = start
    for k, (offset, length) in enumerate(seen):
        assert offset == at
        if k:
            assert offset % FOLIO_BYTES == 0
        if k < len(seen) - 1:
            assert (offset + length) % FOLIO_BYTES == 0
        at += length
    assert at == start + size


@pytest.mark.parametrize("start", [0, 4096, FOLIO_BYTES + 7])
def test_writes_land_in_order_in_whole_folios(tmp_path: Path, writes: list[tuple[int, int]], start: int) -> None:
    rng = np.random.default_rng(start)
    sizes = [0, 1, 8, 4095, FOLIO_BYTES - 3, FOLIO_BYTES, 3 * FOLIO_BYTES + 11, 17, 5 * FOLIO_BYTES]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in rng.permutation(sizes)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"\xee" * start, 0)
        writer = AlignedWriter(fd, start)
        for piece in pieces:
            writer.write(piece.data if piece.size % 2 else piece.tobytes())
        assert writer.position == start + sum(sizes)
        writer.close()
        writer.close()  # idempotent: nothing left to write
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\xee" * start + b"".join(p.tobytes() for p in pieces)
    _check_folios(writes, start, sum(sizes))


def test_copy_is_exact_whole_folios_and_stops_when_cancelled(tmp_path: Path, writes: list[tuple[int, int]]) -> None:
    data = np.random.default_rng(1).integers(0, 256, 5 * FOLIO_BYTES + 123, dtype=np.uint8).tobytes()
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert copy_aligned(src, dst, len(data)) == len(data)
        cancel = threading.Event()
        cancel.set()
        assert copy_aligned(src, dst, len(data), cancel) == 0
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == data
    _check_folios(writes, 0, len(data))


def test_copy_of_a_file_shorter_than_said_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"x" * 100)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError, match="holds 100 bytes, not the 200 to copy"):
            copy_aligned(src, dst, 200)
    finally:
        os.close(src)
        os.close(dst)


def test_a_staged_keyframe_and_its_private_copy_are_written_in_whole_folios(
    tmp_path: Path, writes: list[tuple[int, int]]
) -> None:
    """The two writers of a publisher's base: its keyframe's files and their copy."""
    rng = np.random.default_rng(2)
    specs = {f"t{i}": TensorSpec(f"t{i}", "BF16", (300 + i, 1000)) for i in range(7)}
    staged = StagedKeyframe(tmp_path / "kf", specs, 1 << 40)
    for name in sorted(specs):
        staged.write(name, rng.integers(0, 65535, specs[name].numel, dtype=np.uint16))
    [file] = staged.finish()
    _check_folios(writes, 0, file.size)
    assert file.size == file.path.stat().st_size
    before = file.path.read_bytes()
    os.link(file.path, tmp_path / "store-object")
    writes.clear()
    assert make_private(file.path)
    _check_folios(writes, 0, file.size)
    assert file.path.read_bytes() == before
    assert file.path.stat().st_nlink == 1
