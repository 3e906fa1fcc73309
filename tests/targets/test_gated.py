"""The sidecar's GatedTarget, wrapping a target, passes the contract too: it forwards
every method and capability (no gate is bridged here, so nothing pauses)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from numpy.typing import NDArray

from bulletin import Publisher, Subscriber
from bulletin.sidecar.worker import GatedTarget
from bulletin.target import ArrayTarget, LocalDirTarget, WeightTarget
from tests.run.helpers import ToyTrainer
from tests.targets.contract import TargetContract


def _inner(target: WeightTarget) -> ArrayTarget:
    assert isinstance(target, GatedTarget) and isinstance(target.inner, ArrayTarget)
    return target.inner


class TestGatedArrayTarget(TargetContract):
    @pytest.fixture
    def target(self) -> Iterator[WeightTarget]:
        target = GatedTarget(ArrayTarget())
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        return _inner(target).arrays

    def active_version(self, target: WeightTarget) -> int | None:
        return _inner(target).version


def test_the_wrapper_takes_its_capabilities_from_the_inner_target() -> None:
    gated = GatedTarget(ArrayTarget())
    assert gated.supports_shards and gated.in_place
    assert not GatedTarget(ArrayTarget(), in_place=False).in_place


def test_the_wrapper_passes_model_files_on_to_a_folder(tmp_path: Path) -> None:
    """An engine target keeping a folder behind the sidecar's gate gets each version's
    model files: a version that only changes a file reaches the folder too."""
    store = tmp_path / "bucket"
    trainer = ToyTrainer(seed=5)
    versions = [{"config.json": b'{"a": 1}'}, {"config.json": b'{"a": 2}', "tokenizer.json": b"{}"}]
    with Publisher(store, "r", keyframe_every=10) as pub:
        for i, files in enumerate(versions):
            if i:
                trainer.step()
            pub.publish(trainer.state, files=files)
    node = tmp_path / "node"
    gated = GatedTarget(LocalDirTarget(node))
    with Subscriber(store, "r", target=gated) as sub:
        for version, files in enumerate(versions, start=1):
            assert sub.sync(version) == version
            held = {p.name: p.read_bytes() for p in (node / "current").iterdir() if p.suffix == ".json"}
            held.pop("model.safetensors.index.json", None)
            assert held == files, version
    gated.close()


class _StreamedOnly(LocalDirTarget):
    def load_full(self, tensors: Mapping[str, NDArray[Any]], specs: Any) -> None:
        raise AssertionError("a folder behind the gate must stream keyframes into place, not load copies")


def test_a_folder_behind_the_wrapper_streams_keyframes_into_place(tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=6)
    with Publisher(tmp_path / "bucket", "r", keyframe_every=1) as pub:
        pub.publish(trainer.state)
        trainer.step()
        pub.publish(trainer.state)
    gated = GatedTarget(_StreamedOnly(tmp_path / "node"))
    assert gated.in_place and gated.inner.stages_keyframes  # applies change files in place; keyframes do not
    with Subscriber(tmp_path / "bucket", "r", target=gated) as sub:
        assert sub.sync(1) == 1 and sub.sync(2) == 2  # two keyframes
    gated.close()
