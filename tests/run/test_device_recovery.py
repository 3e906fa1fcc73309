"""The trainer's device path after a failed publish, emulated on the host.

The bits of GPU tensors are kept on the device and move on when a snapshot is diffed
there, before its commit. After any failed publish (a lost commit response, a real
conflict, an upload that failed) the next publish must diff against the last committed
version again, and the keyframe schedule must not drift; so must a snapshot refused
part way (a bad tensor after others were diffed on the device). CI has no GPU: here the
device is the NumPy twin (``bulletin_kernels.numpy_twin`` has the CUDA path's signatures) behind
a stand-in ``cupy`` module; tests/run/test_gpu_recovery.py runs the same on a GPU.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bulletin.snapshot
from bulletin import Publisher, Subscriber
from bulletin.device_kept import DeviceKept
from bulletin.errors import InvalidInput, StorageUnavailable, VersionConflict
from bulletin.maintenance import verify
from bulletin.run import Run
from bulletin.storage import WriteResult, open_store
from bulletin.target import ArrayTarget
from tests.run.helpers import ToyTrainer, assert_bits_equal
from tests.run.test_ambiguous_commit import LostCommitResponse


class OnDevice(np.ndarray):  # type: ignore[type-arg]
    """An array the emulated device path treats as a GPU tensor."""


@pytest.fixture
def emulated_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    cupy = types.ModuleType("cupy")
    cupy.asnumpy = lambda array: np.array(array, copy=True)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(bulletin.snapshot, "on_gpu", lambda value: isinstance(value, OnDevice))
    yield


def _on_device(state: dict[str, np.ndarray]) -> dict[str, Any]:
    return {name: np.ascontiguousarray(w).view(OnDevice) for name, w in state.items()}


def found_on_device(monkeypatch: pytest.MonkeyPatch, owner: type, method: str) -> list[bool]:
    """Whether each call of ``owner.method`` (a device diff) found a change, in order."""
    found: list[bool] = []
    real = getattr(owner, method)

    def counted(self: Any, name: str, value: Any) -> Any:
        change = real(self, name, value)
        found.append(change is not None)
        return change

    monkeypatch.setattr(owner, method, counted)
    return found


@pytest.mark.usefixtures("emulated_device")
def test_the_emulated_device_is_the_device_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the tests here rely on: a patch version's tensors are diffed by the device's
    # kept bits (DeviceKept.diff finds their changes), not read to the host.
    found = found_on_device(monkeypatch, DeviceKept, "diff")
    trainer = ToyTrainer(seed=60)
    with Publisher(str(tmp_path), "run", keyframe_every=4) as pub:
        pub.publish(_on_device(trainer.state))
        trainer.step()
        pub.publish(_on_device(trainer.state))
    assert found == [True] * len(trainer.state)


class FailingUploads(LostCommitResponse):
    """Also fails patch shard uploads while ``uploads_fail`` is set."""

    uploads_fail = False

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        if self.uploads_fail and "/patches/" in key:
            raise StorageUnavailable(f"{key}: service unavailable (injected)")
        return super().put_if_absent(key, data)


@pytest.mark.usefixtures("emulated_device")
@pytest.mark.parametrize("failure", ["lost-commit", "conflict", "upload", "bad-input"])
def test_the_device_path_diffs_against_the_last_commit_after_a_failure(tmp_path: Path, failure: str) -> None:
    url = str(tmp_path / "bucket")
    store = FailingUploads(open_store(url))
    trainer = ToyTrainer(seed=61)
    served = {}
    pub = Publisher(store, "run", keyframe_every=4)
    for version in (1, 2):
        if version > 1:
            trainer.step()
        assert pub.publish(_on_device(trainer.state)) == version
        served[version] = trainer.served()
    trainer.step()
    if failure == "lost-commit":
        store.arm(reads=1)
        with pytest.raises(StorageUnavailable):
            pub.publish(_on_device(trainer.state))
        served[3] = trainer.served()  # settled by the next publish
    elif failure == "conflict":
        Publisher(url, "run").publish({"other": np.zeros(3, np.float32)})
        with pytest.raises(VersionConflict):
            pub.publish(_on_device(trainer.state))
        run = Run(open_store(url), "run")  # roll the other trainer's version back
        head = run.read_head()
        assert head is not None
        run.store.delete(run.key(f"manifests/{3:020d}.json"))
        back = head.head.model_copy(update={"version": 2, "manifest_digest": run.read_manifest(2).digest})
        run.store.put_if_match(run.key("head.json"), back.model_dump_json().encode(), head.etag)
    elif failure == "bad-input":  # refused while snapshotting, after the device diffed the others
        with pytest.raises(InvalidInput):
            pub.publish({**_on_device(trainer.state), "zz.not_a_tensor": [1, 2]})
    else:
        store.uploads_fail = True
        with pytest.raises(StorageUnavailable):
            pub.publish(_on_device(trainer.state))
        store.uploads_fail = False
    first = max(served) + 1
    for version in range(first, 8):
        trainer.step()
        assert pub.publish(_on_device(trainer.state)) == version
        served[version] = trainer.served()
    pub.close()
    assert [r.keyframe for r in pub.results if r.version >= 4] == [False, True, False, False]
    for version, bits in served.items():
        node = ArrayTarget()
        assert Subscriber(url, "run", target=node).sync(version) == version
        assert_bits_equal(node.arrays, bits)
    report = verify(Run(open_store(url), "run"))
    assert report.ok, report.problems
