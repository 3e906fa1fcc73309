"""bulletin.fileio's atomic writes: the old file or the new one, never a temp left, and
``durable=False`` (the publisher's cache state) issuing no fsync at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bulletin.fileio import atomic_file, write_atomic


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each fsync issued (the real ones still run)."""
    seen: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        seen.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    return seen


@pytest.mark.parametrize(("durable", "count"), [(True, 2), (False, 0)])
def test_replaces_the_file_with_or_without_fsync(tmp_path: Path, fsyncs: list[int], durable: bool, count: int) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    write_atomic(target, [b"n", memoryview(b"ew")], durable=durable)
    assert target.read_bytes() == b"new"
    assert len(fsyncs) == count  # the file and its folder, or nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


@pytest.mark.parametrize("durable", [True, False])
def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path, durable: bool) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="midway"), atomic_file(target, durable=durable) as fh:
        fh.write(b"half")
        raise RuntimeError("midway")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
