"""A subscriber reading several stores (its region's mirror, then the origin): fallback on
errors and lag, one hash chain whichever store answers, and idle polls that stay cheap."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bulletin import Publisher, Subscriber
from bulletin.errors import ChainMismatch, ConfigError, StorageUnavailable
from bulletin.mirror import Mirror
from bulletin.run import Run
from bulletin.signing import Signer, TrustPolicy
from bulletin.sources import Sources
from bulletin.storage import open_store
from bulletin.target import ArrayTarget
from scripts.bench_mirror import Egress
from tests.mirror.helpers import OutageStore
from tests.run.helpers import ToyTrainer, assert_bits_equal, publish_versions
from tests.run.rollback import rewrite


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Origin:
    """An origin run with a trainer that keeps publishing, and a mirror of it."""

    def __init__(self, tmp_path: Path, *, signer: Signer | None = None, seed: int = 0) -> None:
        self.url, self.mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
        self.trainer = ToyTrainer(seed=seed)
        self.signer = signer
        self.served: dict[int, dict] = {}

    def publish(self, count: int = 1) -> int:
        with Publisher(self.url, "run", keyframe_every=3, signing_key=self.signer) as pub:
            for _ in range(count):
                if self.served:
                    self.trainer.step()
                version = pub.publish(self.trainer.state)
                self.served[version] = self.trainer.served()
        return version

    def copy(self, trust: TrustPolicy | None = None) -> None:
        Mirror(self.url, self.mirror, "run", trust=trust).sync()


def _reads_of_versions(counted: Egress) -> set[str]:
    """Keys read other than the head (manifests, signatures, data)."""
    return {k for k in counted.reads if not k.endswith("head.json")}


def test_a_node_reads_its_mirror_and_only_polls_the_origin_now_and_then(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(5)
    run.copy()
    origin, mirror = Egress(open_store(run.url)), Egress(open_store(run.mirror))
    node = ArrayTarget()
    sub = Subscriber([mirror, origin], "run", target=node)
    assert sub.sync() == 5
    assert_bits_equal(node.arrays, run.served[5])
    assert _reads_of_versions(origin) == set()  # the origin's head only, for the lag rule
    before = (mirror.requests, origin.requests)
    for _ in range(20):
        assert sub.head_version() == 5
    assert (mirror.requests - before[0], origin.requests - before[1]) == (20, 0)  # one GET each, mirror only
    run.publish(2)
    run.copy()
    assert sub.head_version() == 7 and sub.sync() == 7
    assert_bits_equal(node.arrays, run.served[7])
    assert _reads_of_versions(origin) == set()
    assert mirror.data_reads() and not origin.data_reads()


def test_with_no_grace_every_poll_reads_every_head(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(2)
    run.copy()
    origin, mirror = Egress(open_store(run.url)), Egress(open_store(run.mirror))
    sub = Subscriber([mirror, origin], "run", target=ArrayTarget(), lag_grace=0)
    sub.sync()
    before = (mirror.requests, origin.requests)
    for _ in range(10):
        sub.head_version()
    assert (mirror.requests - before[0], origin.requests - before[1]) == (10, 10)


def _node_at_4(tmp_path: Path) -> tuple[Origin, OutageStore, Subscriber, ArrayTarget]:
    """A run of 4 versions, mirrored; a node at version 4 reading [mirror, origin]."""
    run = Origin(tmp_path)
    run.publish(4)
    run.copy()
    mirror = OutageStore(open_store(run.mirror))
    node = ArrayTarget()
    sub = Subscriber([mirror, run.url], "run", target=node)
    assert sub.sync() == 4
    return run, mirror, sub, node


def test_a_mirror_down_falls_back_to_the_origin_and_is_passed_over_meanwhile(tmp_path: Path) -> None:
    run, mirror, sub, node = _node_at_4(tmp_path)
    mirror.down = True
    run.publish(1)  # not mirrored: the mirror is down
    assert sub.sync() == 5
    assert_bits_equal(node.arrays, run.served[5])
    assert mirror.calls_while_down == 1  # then passed over for retry_after seconds
    assert sub.head_version() == 5 and mirror.calls_while_down == 1


def test_retry_after_brings_a_recovered_store_back_first(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(2)
    run.copy()
    clock = Clock()
    mirror, origin = OutageStore(open_store(run.mirror)), Egress(open_store(run.url))
    sources = Sources([mirror, origin], "run", retry_after=30, lag_grace=3600, clock=clock)
    mirror.down = True
    assert sources.poll().head.version == 2  # type: ignore[union-attr]
    mirror.down = False
    clock.now += 29
    before = origin.requests
    sources.poll()
    assert origin.requests == before + 1  # the mirror is still passed over
    clock.now += 1
    sources.poll()
    assert origin.requests == before + 1  # back to the mirror


def test_a_missing_or_corrupt_object_in_the_mirror_is_fetched_from_the_origin(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(6)
    run.copy()
    mirror_run = Run(open_store(run.mirror), "run")
    node = ArrayTarget()
    assert Subscriber([run.mirror, run.url], "run", target=node).sync(4) == 4
    five = mirror_run.read_manifest(5).manifest.patch.shards[0]  # type: ignore[union-attr]
    six = mirror_run.read_manifest(6).manifest.patch.shards[0]  # type: ignore[union-attr]
    mirror_run.store.delete(mirror_run.key(five.key))
    path = tmp_path / "mirror" / "run" / six.key
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    origin = Egress(open_store(run.url))
    sub = Subscriber([run.mirror, origin], "run", target=node)
    assert sub.sync(5) == 5
    assert_bits_equal(node.arrays, run.served[5])
    assert set(origin.data_reads()) == {f"run/{five.key}"}
    assert sub.sync(6) == 6
    assert_bits_equal(node.arrays, run.served[6])
    assert origin.data_reads()[f"run/{six.key}"] == 1


def test_a_mirror_lagging_longer_than_the_grace_is_passed_over_until_it_catches_up(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(5)
    run.copy()
    run.publish(2)  # the origin is at 7, the mirror at 5
    clock = Clock()
    mirror, origin = Egress(open_store(run.mirror)), Egress(open_store(run.url))
    sources = Sources([mirror, origin], "run", lag_grace=10, clock=clock)
    assert sources.poll().head.version == 5  # type: ignore[union-attr]
    assert sources.tip().version == 5  # type: ignore[union-attr]
    clock.now += 9
    assert sources.poll().head.version == 5  # type: ignore[union-attr]
    clock.now += 1  # the origin has shown version 7 for 10 s, the mirror still lacks it
    assert sources.poll().head.version == 7  # type: ignore[union-attr]
    assert sources.tip().version == 7  # type: ignore[union-attr]
    run.copy()  # caught up: the mirror counts again
    assert sources.poll().head.version == 7  # type: ignore[union-attr]
    before = origin.requests
    clock.now += 5
    assert sources.tip().version == 7  # type: ignore[union-attr]
    assert origin.requests == before  # the mirror answered; the origin is not due yet

    # Through a Subscriber: no grace, so a node takes the newest at once, from the origin.
    run.publish(1)
    node = ArrayTarget()
    assert Subscriber([run.mirror, run.url], "run", target=node, lag_grace=0).sync() == 8
    assert_bits_equal(node.arrays, run.served[8])
    assert Subscriber([run.mirror, run.url], "run", target=ArrayTarget()).sync() == 7  # within the grace


def test_a_mirror_trailing_by_less_than_the_grace_is_never_passed_over(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(3)
    run.copy()
    clock = Clock()
    origin = Egress(open_store(run.url))
    sources = Sources([run_store := open_store(run.mirror), origin], "run", lag_grace=10, clock=clock)
    del run_store
    for step in range(6):
        run.publish(1)  # the origin moves; the others are read now and then
        clock.now += 6
        assert sources.poll().head.version == 3 + step  # type: ignore[union-attr]
        run.copy()  # the mirror catches up within the grace every time
        assert sources.poll().head.version == 4 + step  # type: ignore[union-attr]
    assert _reads_of_versions(origin) == set()


def test_stores_serving_different_chains_are_refused_and_never_mixed(tmp_path: Path) -> None:
    one, other = str(tmp_path / "one"), str(tmp_path / "other")
    served = publish_versions(one, "run", 3, seed=1, keyframe_every=3)
    publish_versions(other, "run", 5, seed=2, keyframe_every=3)  # another trainer's chain, further on
    node = ArrayTarget()
    with pytest.raises(ChainMismatch, match="different chains"):
        Subscriber([one, other], "run", target=node, lag_grace=0).sync()
    assert node.layout() is None  # nothing was loaded
    held = Subscriber([one, other], "run", target=node, lag_grace=3600)
    assert held.sync() == 3  # within the grace: the first store's chain
    fingerprints = node.full_fingerprints()
    with pytest.raises(ChainMismatch):
        Subscriber([one, other], "run", target=node, lag_grace=0).sync()
    assert node.full_fingerprints() == fingerprints
    assert_bits_equal(node.arrays, served[-1])


def test_the_held_version_is_checked_whichever_store_answers(tmp_path: Path) -> None:
    run, mirror, sub, node = _node_at_4(tmp_path)
    rewrite(run.url, "run", 6, seed=9)  # the origin was replaced by another chain
    mirror.down = True
    with pytest.raises(ChainMismatch):
        sub.sync()
    assert sub.current_version == 4
    assert_bits_equal(node.arrays, run.served[4])


def test_every_store_failing_is_one_typed_error_naming_each(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(1)
    run.copy()
    stores = [OutageStore(open_store(run.mirror)), OutageStore(open_store(run.url))]
    for store in stores:
        store.down = True
    with pytest.raises(StorageUnavailable, match="every store") as caught:
        Subscriber(stores, "run", target=ArrayTarget()).sync()
    assert run.mirror in str(caught.value) and run.url in str(caught.value)
    with pytest.raises(ConfigError):
        Subscriber([], "run")


def test_a_signed_run_through_a_mirror_behind_a_head_already_seen(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    run = Origin(tmp_path, signer=Signer(key))
    trust = TrustPolicy([key.public_key()])
    run.publish(3)
    run.copy(trust)
    run.publish(1)  # origin at 4, the mirror at 3: its head is older than the origin's, seen below
    origin = Egress(open_store(run.url))
    node = ArrayTarget()
    sub = Subscriber([run.mirror, origin], "run", target=node, trust=trust)
    assert sub.sync() == 3  # the origin's head (4) was read for the lag rule: the policy saw it
    assert sub.head_version() == 3  # the mirror's older head is not an attack: it lags, within the grace
    run.copy(TrustPolicy([key.public_key()]))
    assert sub.head_version() == 4 and sub.sync() == 4
    assert_bits_equal(node.arrays, run.served[4])
    assert _reads_of_versions(origin) == set()


def test_an_empty_mirror_is_passed_over_at_once(tmp_path: Path) -> None:
    run = Origin(tmp_path)
    run.publish(2)  # never mirrored: the region's mirror is still empty
    node = ArrayTarget()
    sub = Subscriber([run.mirror, run.url], "run", target=node)  # the default grace
    assert sub.head_version() == 2 and sub.sync() == 2
    assert_bits_equal(node.arrays, run.served[2])
    run.copy()
    run.publish(1)
    assert sub.head_version() == 2  # filled now: the mirror counts again, within the grace
