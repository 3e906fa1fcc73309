"""Keyframes stream from the store to files; folds go in a bounded working set.

A keyframe is never read into memory whole (the store's ``get`` is refused for it here:
only the streamed ``get_to_file`` may fetch it), lands once, verified, in the node's new
model folder, and every tensor is fingerprinted once. Targets that are not folders get
views of the streamed files' memory maps, not anonymous copies. A node far behind
catches up in rounds, each landing on an exact version.
"""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bulletin.sync
import bulletin.target
from bulletin import Subscriber
from bulletin.checkpoint import Checkpoint
from bulletin.errors import DigestMismatch
from bulletin.storage import Store, open_store
from bulletin.storage.base import ObjectData
from bulletin.storage.wrapper import WrapperStore
from bulletin.target import ArrayTarget, LocalDirTarget
from patcher.fingerprint import fingerprint
from patcher.patch import TensorSpec
from tests.run.helpers import ToyTrainer, assert_bits_equal

SHAPES = {"w": (128, 64), "b": (64,), "e": (256, 32), "n.norm.weight": (64,)}


class NoWholeKeyframes(WrapperStore):
    """Refuses whole-object reads of keyframe files: only a streamed read may take them."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.streamed: list[str] = []

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        if "/keyframes/" in key:
            raise AssertionError(f"{key}: a keyframe file was read into memory")
        return super().get(key, max_bytes=max_bytes)

    def get_to_file(self, key: str, path: Any, *, sha256: str | None = None, max_bytes: int | None = None) -> Any:
        self.streamed.append(key)
        return super().get_to_file(key, path, sha256=sha256, max_bytes=max_bytes)


def publish(url: str, versions: int, *, keyframe_every: int = 100, lr: float = 3e-4) -> dict[int, dict[str, Any]]:
    """The bits every version serves."""
    from bulletin import Publisher

    trainer = ToyTrainer(seed=61, shapes=SHAPES)
    served = {}
    with Publisher(url, "run", keyframe_every=keyframe_every) as pub:
        for version in range(1, versions + 1):
            if version > 1:
                trainer.step(lr=lr)
            assert pub.publish(trainer.state) == version
            served[version] = trainer.served()
    return served


@pytest.fixture
def run_url(tmp_path: Path) -> tuple[str, dict[int, dict[str, Any]]]:
    url = str(tmp_path / "bucket")
    return url, publish(url, 3)


def test_a_fresh_node_streams_the_keyframe_into_its_folder(
    run_url: tuple[str, dict[int, dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served = run_url
    store = NoWholeKeyframes(open_store(url))
    hashed: list[int] = []
    real = bulletin.sync.fingerprint

    def counting(bits: Any) -> int:
        hashed.append(bits.size)
        return real(bits)

    monkeypatch.setattr(bulletin.sync, "fingerprint", counting)
    monkeypatch.setattr(bulletin.target, "fingerprint", counting)
    node = tmp_path / "node"
    with Subscriber(store, "run", node) as sub:
        assert sub.sync(1) == 1
        assert sub.stats.last_report is not None and sub.stats.last_report.keyframe == 1
        assert sub.stats.last_report.bytes_downloaded > 0
    assert store.streamed and all("/keyframes/" in key for key in store.streamed)
    assert len(hashed) == len(SHAPES)  # every tensor once: checked as it landed, not again
    with Checkpoint(node / LocalDirTarget.CURRENT) as ckpt:
        assert_bits_equal({n: np.array(ckpt.bits(n)) for n in ckpt.specs}, served[1])
    # Nothing but the model folder's own files: no temp file of the stream is left.
    folder = (node / LocalDirTarget.CURRENT).resolve()
    assert sorted(p.name for p in folder.iterdir()) == [LocalDirTarget.MARKER, "model.safetensors"]


class MappedArrayTarget(ArrayTarget):
    """Records whether ``load_full`` was given views of memory maps (file pages)."""

    def __init__(self) -> None:
        super().__init__()
        self.mapped: list[bool] = []

    def load_full(self, tensors: Mapping[str, Any], specs: Mapping[str, TensorSpec]) -> None:
        for array in tensors.values():
            base = array
            while isinstance(base, np.ndarray) and base.base is not None:
                base = base.base
            if isinstance(base, memoryview):
                base = base.obj
            self.mapped.append(isinstance(base, mmap.mmap))
        super().load_full(tensors, specs)


def test_other_targets_are_fed_from_the_memory_maps_of_the_streamed_files(
    run_url: tuple[str, dict[int, dict[str, Any]]], tmp_path: Path
) -> None:
    url, served = run_url
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    target = MappedArrayTarget()
    sub = Subscriber(NoWholeKeyframes(open_store(url)), "run", target=target, scratch_dir=scratch)
    assert sub.sync() == 3
    assert target.mapped and all(target.mapped)
    assert_bits_equal(target.arrays, served[3])
    assert list(scratch.iterdir()) == []  # the streamed copy goes once loaded


def test_a_damaged_keyframe_changes_nothing_held(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    publish(url, 4, keyframe_every=3, lr=0.05)  # keyframes 1 and 4
    node = tmp_path / "node"
    with Subscriber(url, "run", node) as sub:
        assert sub.sync(1) == 1
    store = open_store(url)
    key = next(info.key for info in store.list("run/keyframes/") if "00000000000000000004" in info.key)
    data = bytearray(store.get(key).data)
    data[-1] ^= 1
    store.delete(key)
    store.put_if_absent(key, bytes(data))
    before = sorted(p.name for p in node.iterdir())
    with Subscriber(url, "run", node) as sub, pytest.raises(DigestMismatch):
        sub.sync(4)
    assert sorted(p.name for p in node.iterdir()) == before  # no half-streamed folder left
    target = LocalDirTarget(node, run="run")
    try:
        held = target.restored()
        assert held is not None and held.version == 1
        assert target.full_fingerprints() == held.fingerprints
    finally:
        target.close()


def test_a_node_far_behind_catches_up_in_rounds_of_exact_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    served = publish(url, 9, lr=1e-2)
    node = tmp_path / "node"
    with Subscriber(url, "run", node) as sub:
        assert sub.sync(1) == 1
    # Rounds of about three versions' changes (the bound is a share of the model's size).
    monkeypatch.setattr(bulletin.sync, "FOLD_BATCH_BYTES", 1)
    step = max(bulletin.sync._decoded_bound(m) for m in (sub.sources.read_manifest(v) for v in range(2, 10)))
    total = sub.sources.read_manifest(9).manifest.stats.total_bytes
    monkeypatch.setattr(bulletin.sync, "ROUND_SHARE", 3 * step / total)
    activated: list[int] = []
    with Subscriber(url, "run", node) as sub:
        real = sub._activated
        monkeypatch.setattr(sub, "_activated", lambda stored: (activated.append(stored.version), real(stored)))
        assert sub.sync(9) == 9
        report = sub.stats.last_report
        assert report is not None and report.transitions == 8
        assert sub.target.full_fingerprints() == {n: fingerprint(b) for n, b in served[9].items()}
    assert len(activated) > 1 and activated[-1] == 9 and activated == sorted(activated)  # exact versions
