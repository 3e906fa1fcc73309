"""A long-lived publisher survives a commit whose outcome it could not see.

The store wrapper lets a manifest's create-only PUT land, then loses its response
(``StorageUnavailable``, as a dropped connection would) and, if asked, the next reads
of that manifest too. The publisher must settle it (its own bytes: committed) and go
on; a version that another writer committed must keep being a ``VersionConflict``.
Run on the local-directory store here, and on LocalStack when it is configured.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.errors import StorageUnavailable, VersionConflict
from bulletin.maintenance import verify
from bulletin.run import Run
from bulletin.storage import Store, WriteResult, open_store
from bulletin.storage.base import ObjectData
from bulletin.storage.wrapper import WrapperStore
from bulletin.target import ArrayTarget
from schemas.head import HeadV1
from tests.run.helpers import ToyTrainer, assert_bits_equal


class LostCommitResponse(WrapperStore):
    """Loses the response of the next manifest creation once armed, and then the next
    ``reads`` reads of that manifest; ``land=False`` loses the request instead."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._armed = False
        self._land = True
        self._reads = 0
        self.lost: str | None = None

    def arm(self, *, reads: int = 0, land: bool = True) -> None:
        with self._lock:
            self._armed, self._reads, self._land = True, reads, land

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        with self._lock:
            fire = self._armed and "/manifests/" in key
            if fire:
                self._armed, self.lost = False, key
        if not fire:
            return super().put_if_absent(key, data)
        if self._land:
            super().put_if_absent(key, data)
        raise StorageUnavailable(f"{key}: connection reset by peer (injected)")

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        with self._lock:
            lose = key == self.lost and self._reads > 0
            if lose:
                self._reads -= 1
        if lose:
            raise StorageUnavailable(f"{key}: read timed out (injected)")
        return super().get(key, max_bytes=max_bytes)


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        url: str = request.getfixturevalue("s3_url")
        return url
    return str(tmp_path / "bucket")


def _check_node_syncs(url: str, served: dict[int, dict[str, np.ndarray]]) -> None:
    for version in sorted(served):
        node = ArrayTarget()
        assert Subscriber(url, "run", target=node).sync(version) == version
        assert_bits_equal(node.arrays, served[version])
    node = ArrayTarget()
    assert Subscriber(url, "run", target=node).sync() == max(served)
    assert_bits_equal(node.arrays, served[max(served)])
    report = verify(Run(open_store(url), "run"))
    assert report.ok, report.problems


def test_a_lost_commit_response_read_back_at_once(store_url: str) -> None:
    store = LostCommitResponse(open_store(store_url))
    trainer = ToyTrainer(seed=21)
    served = {}
    with Publisher(store, "run", keyframe_every=3) as pub:
        for version in range(1, 6):
            if version > 1:
                trainer.step()
            if version == 2:
                store.arm()
            assert pub.publish(trainer.state) == version
            served[version] = trainer.served()
        assert store.lost is not None and store.lost.endswith(f"{2:020d}.json")
        assert [r.version for r in pub.results] == [1, 2, 3, 4, 5]
    assert Run(open_store(store_url), "run").read_head().head.version == 5  # type: ignore[union-attr]
    _check_node_syncs(store_url, served)


@pytest.mark.parametrize("land", [True, False], ids=["landed", "not-landed"])
def test_an_unknown_commit_outcome_is_settled_by_the_next_publish(store_url: str, land: bool) -> None:
    store = LostCommitResponse(open_store(store_url))
    trainer = ToyTrainer(seed=22)
    served = {}
    with Publisher(store, "run", keyframe_every=4) as pub:
        for _ in range(2):
            served[pub.publish(trainer.state)] = trainer.served()
            trainer.step()
        store.arm(reads=1, land=land)
        with pytest.raises(StorageUnavailable, match="may or may not have taken effect"):
            pub.publish(trainer.state)
        assert pub.version == 2  # the base of the next diff is still the last version seen committed
        served[3] = trainer.served()  # settled by the next publish: committed either way
        for version in range(4, 7):  # 5 is a keyframe, 4 and 6 patches on top of the settled 3
            trainer.step()
            assert pub.publish(trainer.state) == version
            served[version] = trainer.served()
        assert [r.version for r in pub.results] == [1, 2, 3, 4, 5, 6]
    run = Run(open_store(store_url), "run")
    assert run.versions() == [1, 2, 3, 4, 5, 6]
    assert run.read_manifest(3).manifest.writer == pub.writer
    assert run.read_head().head.version == 6  # type: ignore[union-attr]
    _check_node_syncs(store_url, served)


def test_background_publishing_survives_a_lost_commit_response(store_url: str) -> None:
    store = LostCommitResponse(open_store(store_url))
    trainer = ToyTrainer(seed=23)
    served = {}
    with Publisher(store, "run", queue_size=1) as pub:
        served[pub.publish_async(trainer.state).result().version] = trainer.served()
        store.arm(reads=1)
        trainer.step()
        lost = pub.publish_async(trainer.state)
        with pytest.raises(StorageUnavailable):
            pub.flush()
        with pytest.raises(StorageUnavailable):
            lost.result()
        served[2] = trainer.served()
        for version in (3, 4):
            trainer.step()
            assert pub.publish_async(trainer.state).result().version == version
            served[version] = trainer.served()
    _check_node_syncs(store_url, served)


def test_a_real_conflict_keeps_the_publisher_consistent(store_url: str) -> None:
    trainer = ToyTrainer(seed=24)
    served = {}
    pub = Publisher(store_url, "run", keyframe_every=10)
    for _ in range(2):
        served[pub.publish(trainer.state)] = trainer.served()
        trainer.step()
    other = Publisher(store_url, "run")
    assert other.publish(ToyTrainer(seed=99).state) == 3
    for _ in range(2):  # the same clear error every time: another trainer owns the run
        with pytest.raises(VersionConflict, match="another") as info:
            pub.publish(trainer.state)
        assert other.writer in str(info.value)
        assert pub.version == 2
    run = Run(open_store(store_url), "run")
    assert run.versions() == [1, 2, 3]

    # The other trainer's version is rolled back: the tip is this publisher's own again,
    # and it continues from it, diffing against the bits it last committed.
    head = run.read_head()
    assert head is not None
    run.store.delete(run.key("manifests/" + f"{3:020d}.json"))
    v2 = run.read_manifest(2)
    back = HeadV1(run="run", version=2, manifest_digest=v2.digest, updated_at=head.head.updated_at)
    run.store.put_if_match(run.key("head.json"), back.model_dump_json().encode(), head.etag)
    assert pub.publish(trainer.state) == 3
    served[3] = trainer.served()
    trainer.step()
    assert pub.publish(trainer.state) == 4
    served[4] = trainer.served()
    pub.close()
    assert not pub.results[-1].keyframe and not pub.results[-2].keyframe
    _check_node_syncs(store_url, served)


class HeadWritesFail(WrapperStore):
    """Every write of the head fails while ``failing`` is set."""

    failing = False

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        if self.failing and key.endswith("/head.json"):
            raise StorageUnavailable(f"{key}: service unavailable (injected)")
        return super().put_if_absent(key, data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        if self.failing and key.endswith("/head.json"):
            raise StorageUnavailable(f"{key}: service unavailable (injected)")
        return super().put_if_match(key, data, etag)


def test_a_head_that_cannot_move_does_not_fail_a_committed_version(store_url: str) -> None:
    store = HeadWritesFail(open_store(store_url))
    run = Run(open_store(store_url), "run")
    trainer = ToyTrainer(seed=25)
    served = {}
    pub = Publisher(store, "run")
    served[pub.publish(trainer.state)] = trainer.served()
    store.failing = True
    for version in (2, 3):
        trainer.step()
        assert pub.publish(trainer.state) == version  # committed: the head is only a hint
        served[version] = trainer.served()
    assert run.read_head().head.version == 1  # type: ignore[union-attr]
    assert run.tip().version == 3  # type: ignore[union-attr]
    store.failing = False
    pub.close()  # moves the head over what the commits could not
    assert run.read_head().head.version == 3  # type: ignore[union-attr]
    _check_node_syncs(store_url, served)
