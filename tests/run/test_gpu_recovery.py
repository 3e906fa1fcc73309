"""The GPU path recovers from a failed publish like the CPU path (needs a CUDA GPU).

A GPU tensor's previous bits live on the device and move on when a snapshot is diffed
there, before the commit; after a failed commit the next publish must diff against the
last committed version again, not against the snapshot that failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.errors import StorageUnavailable, VersionConflict
from bulletin.maintenance import verify
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget
from tests.run.test_ambiguous_commit import LostCommitResponse

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _masters() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"w": torch.randn(512, 257) * 0.02, "b": torch.randn(257) * 0.02, "n": torch.arange(7)}


def _step(masters: dict[str, Any]) -> None:
    for tensor in masters.values():
        if tensor.is_floating_point():
            tensor.add_(1e-3 * torch.randn(tensor.shape))


def _served(masters: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name, t in masters.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        width = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[want.element_size()]
        out[name] = want.contiguous().view(width).numpy().copy()
    return out


def _check(url: str, served: dict[int, dict[str, np.ndarray]]) -> None:
    for version, bits in served.items():
        node = ArrayTarget()
        assert Subscriber(url, "run", target=node).sync(version) == version
        for name, want in bits.items():
            assert np.array_equal(node.arrays[name].reshape(want.shape), want), (version, name)
    report = verify(Run(open_store(url), "run"))
    assert report.ok, report.problems


def test_a_gpu_publisher_survives_a_lost_commit_response(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    store = LostCommitResponse(open_store(url))
    masters = _masters()
    served = {}
    with Publisher(store, "run", keyframe_every=4) as pub:
        for version in range(1, 8):
            if version > 1:
                _step(masters)
            gpu = {n: t.cuda() for n, t in masters.items()}
            if version == 3:  # a patch diffed on the device, whose commit outcome is lost
                store.arm(reads=1)
                with pytest.raises(StorageUnavailable):
                    pub.publish(gpu)
            else:
                assert pub.publish(gpu) == version
            served[version] = _served(masters)
    _check(url, served)


def test_a_gpu_publisher_after_a_real_conflict_diffs_against_its_last_commit(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    masters = _masters()
    served = {}
    pub = Publisher(url, "run", keyframe_every=10)
    for version in (1, 2):
        if version > 1:
            _step(masters)
        assert pub.publish({n: t.cuda() for n, t in masters.items()}) == version
        served[version] = _served(masters)
    Publisher(url, "run").publish({"w": torch.zeros(3)})  # another trainer takes version 3
    _step(masters)
    with pytest.raises(VersionConflict):
        pub.publish({n: t.cuda() for n, t in masters.items()})
    run = Run(open_store(url), "run")
    head = run.read_head()
    assert head is not None
    run.store.delete(run.key(f"manifests/{3:020d}.json"))  # rolled back: the tip is ours again
    back = head.head.model_copy(update={"version": 2, "manifest_digest": run.read_manifest(2).digest})
    run.store.put_if_match(run.key("head.json"), back.model_dump_json().encode(), head.etag)
    for version in (3, 4):
        _step(masters)
        assert pub.publish({n: t.cuda() for n, t in masters.items()}) == version
        served[version] = _served(masters)
    pub.close()
    _check(url, served)
