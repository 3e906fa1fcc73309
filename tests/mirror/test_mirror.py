"""A mirror is a verbatim copy with the origin's guarantees: objects checked before their
manifest, manifests create-only in version order, the head last and only forward."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bulletin import Publisher, Subscriber
from bulletin.errors import (
    ChainMismatch,
    ConfigError,
    CorruptData,
    RunRewound,
    StoreNotWritable,
    Unsigned,
    VersionNotFound,
)
from bulletin.keyspace import HEAD, manifest_key, signature_key
from bulletin.maintenance import verify
from bulletin.mirror import Mirror
from bulletin.run import Run
from bulletin.signing import Signer, TrustPolicy
from bulletin.storage import open_store
from bulletin.storage.wrapper import CountingStore, WrapperStore
from bulletin.target import ArrayTarget
from scripts.bench_mirror import Egress
from tests.mirror.helpers import RecordingStore, assert_valid_mirror, head_bytes, objects
from tests.run.helpers import ToyTrainer, assert_bits_equal, publish_versions
from tests.run.rollback import rewind, rewrite


@pytest.fixture
def mirror_url(tmp_path: Path) -> str:
    """The mirror's store: a local directory (the origin, ``store_url``, is of each kind)."""
    return str(tmp_path / "mirror")


def _sync_node(url: str | list[str]) -> ArrayTarget:
    target = ArrayTarget()
    Subscriber(url, "run", target=target).sync()
    return target


def test_a_mirror_is_a_verbatim_copy(store_url: str, mirror_url: str) -> None:
    served = publish_versions(store_url, "run", 7, seed=1, keyframe_every=3)
    report = Mirror(store_url, mirror_url, "run").sync()
    assert report.versions == list(range(1, 8)) and report.head_version == 7 and report.from_version is None
    assert objects(mirror_url) == objects(store_url)  # every object, the head included, byte for byte
    assert assert_valid_mirror(mirror_url) == list(range(1, 8))
    assert verify(Run(open_store(mirror_url), "run")).ok
    assert_bits_equal(_sync_node(mirror_url).arrays, served[-1])

    # Nothing new: nothing written, nothing copied.
    recorded = RecordingStore(open_store(mirror_url))
    again = Mirror(store_url, recorded, "run").sync()
    assert again.versions == [] and again.objects_copied == 0 and recorded.writes == []


def test_writes_come_in_order_objects_signature_manifest_and_the_head_last(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), RecordingStore(open_store(str(tmp_path / "mirror")))
    key = Ed25519PrivateKey.generate()
    trainer = ToyTrainer(seed=3)
    with Publisher(origin, "run", keyframe_every=3, signing_key=Signer(key)) as pub:
        for i in range(5):
            if i:
                trainer.step()
            pub.publish(trainer.state)
    trust = TrustPolicy([key.public_key()])
    report = Mirror(origin, mirror, "run", trust=trust).sync()
    assert report.versions == [1, 2, 3, 4, 5]
    assert all(op == "put_if_absent" for op, _ in mirror.writes)  # the first head too: create-only
    order = [k for _, k in mirror.writes]
    assert order[-1] == f"run/{HEAD}" and order.count(f"run/{HEAD}") == 1
    origin_run = Run(open_store(origin), "run")
    positions = {k: i for i, k in enumerate(order)}
    manifest_at = [positions[f"run/{manifest_key(v)}"] for v in range(1, 6)]
    assert manifest_at == sorted(manifest_at)  # in version order
    for version in range(1, 6):
        stored = origin_run.read_manifest(version)
        m = stored.manifest
        refs = list(m.patch.shards if m.patch else ()) + list(m.keyframe.files if m.keyframe else ())
        before = manifest_at[version - 1]
        assert all(positions[f"run/{ref.key}"] < before for ref in refs), version
        assert positions[f"run/{signature_key(stored.digest)}"] < before, version
        if version > 1:  # nothing of a version before the previous manifest is created
            assert all(positions[f"run/{ref.key}"] > manifest_at[version - 2] for ref in refs), version
    assert objects(str(tmp_path / "mirror")) == objects(origin)  # signatures and the signed head verbatim
    # A node that trusts only the trainer's key syncs from the mirror: the copies verify.
    node = ArrayTarget()
    assert Subscriber(str(tmp_path / "mirror"), "run", target=node, trust=TrustPolicy([key.public_key()])).sync() == 5
    assert_bits_equal(node.arrays, trainer.served())


def test_a_mirror_with_trust_copies_no_unsigned_version(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    key = Ed25519PrivateKey.generate()
    trainer = ToyTrainer(seed=4)
    with Publisher(origin, "run", keyframe_every=3, signing_key=Signer(key)) as pub:
        pub.publish(trainer.state)
    Mirror(origin, mirror, "run", trust=TrustPolicy([key.public_key()])).sync()
    with Publisher(origin, "run", keyframe_every=3) as pub:  # a bucket writer without the key
        trainer.step()
        pub.publish(trainer.state)
    with pytest.raises(Unsigned):
        Mirror(origin, mirror, "run", trust=TrustPolicy([key.public_key()])).sync()
    assert assert_valid_mirror(mirror) == [1]
    assert not [k for k in objects(mirror) if "/00000000000000000002" in k]  # not one object of it


def test_objects_already_there_are_checked_and_other_bytes_are_refused_not_overwritten(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    publish_versions(origin, "run", 3, seed=5, keyframe_every=10)
    origin_run = Run(open_store(origin), "run")
    shard = origin_run.read_manifest(3).manifest.patch.shards[0]  # type: ignore[union-attr]
    Mirror(origin, mirror, "run").sync()
    store = open_store(mirror)
    # As a copy killed after version 3's shard but before its manifest would leave it:
    store.delete(f"run/{HEAD}")
    store.delete(f"run/{manifest_key(3)}")
    counted = Egress(open_store(origin))
    resumed = Mirror(counted, mirror, "run").sync()
    assert resumed.versions == [3] and resumed.objects_checked == 1 and resumed.objects_copied == 0
    assert counted.data_reads() == {}  # checked in the mirror, not read again from the origin
    assert objects(mirror) == objects(origin)

    # The same shard with other bytes: refused, left as it is, and version 3 is not shown.
    store.delete(f"run/{HEAD}")
    store.delete(f"run/{manifest_key(3)}")
    store.delete(f"run/{shard.key}")
    store.put_if_absent(f"run/{shard.key}", b"\x00" * shard.size)
    with pytest.raises(CorruptData, match="not overwritten"):
        Mirror(origin, mirror, "run").sync()
    assert store.get(f"run/{shard.key}").data == b"\x00" * shard.size
    assert assert_valid_mirror(mirror) == [1, 2]
    store.delete(f"run/{shard.key}")  # an operator removes it: the next copy completes
    assert Mirror(origin, mirror, "run").sync().versions == [3]
    assert objects(mirror) == objects(origin)


def test_keep_prunes_and_an_empty_mirror_copies_only_what_the_newest_versions_need(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    trainer = ToyTrainer(seed=6)
    served = {}
    pub = Publisher(origin, "run", keyframe_every=4)  # keyframes 1, 5, 9, 13
    for version in range(1, 11):
        if version > 1:
            trainer.step()
        assert pub.publish(trainer.state) == version
        served[version] = trainer.served()
    counted = Egress(open_store(origin))
    report = Mirror(counted, mirror, "run", keep=3).sync()
    # The newest 3 are 8..10; they start from keyframe 5.
    assert report.versions == [5, 6, 7, 8, 9, 10] and report.pruned_versions == 0
    assert assert_valid_mirror(mirror) == list(range(5, 11))
    read_versions = {int(k.split("/")[2][:20]) for k in counted.data_reads()}
    assert min(read_versions) == 5  # nothing below the kept range was copied
    for version in range(11, 15):
        trainer.step()
        assert pub.publish(trainer.state) == version
        served[version] = trainer.served()
    pub.close()
    report = Mirror(origin, mirror, "run", keep=3).sync()
    assert report.versions == [11, 12, 13, 14] and report.pruned_versions == 4  # 5..8 go, keyframe 9 stays
    assert assert_valid_mirror(mirror) == list(range(9, 15))
    assert not [k for k in objects(mirror) if any(f"/{v:020d}" in k for v in range(1, 9))]
    assert verify(Run(open_store(mirror), "run")).ok
    assert_bits_equal(_sync_node(mirror).arrays, served[14])


def test_a_mirror_far_behind_with_keep_skips_to_the_kept_versions(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    trainer = ToyTrainer(seed=7)
    with Publisher(origin, "run", keyframe_every=4) as pub:
        pub.publish(trainer.state)
        Mirror(origin, mirror, "run", keep=2).sync()
        for _ in range(11):  # versions 2..12; keyframes 5, 9
            trainer.step()
            pub.publish(trainer.state)
    report = Mirror(origin, mirror, "run", keep=2).sync()
    assert report.versions == [9, 10, 11, 12] and report.pruned_versions == 1
    assert assert_valid_mirror(mirror) == [9, 10, 11, 12]
    assert_bits_equal(_sync_node(mirror).arrays, trainer.served())


def test_the_mirror_refuses_an_origin_rewritten_or_rolled_back(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    publish_versions(origin, "run", 4, seed=8, keyframe_every=3)
    Mirror(origin, mirror, "run").sync()
    before = objects(mirror)
    rewind(origin, "run", 2)
    with pytest.raises(RunRewound):
        Mirror(origin, mirror, "run").sync()
    assert objects(mirror) == before
    rewrite(origin, "run", 6, seed=9)
    with pytest.raises(ChainMismatch):
        Mirror(origin, mirror, "run").sync()
    assert objects(mirror) == before


def test_an_origin_garbage_collected_past_the_mirror_is_a_clear_error_without_keep(tmp_path: Path) -> None:
    from datetime import timedelta

    from bulletin.maintenance import collect_garbage

    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    trainer = ToyTrainer(seed=10)
    with Publisher(origin, "run", keyframe_every=3) as pub:
        pub.publish(trainer.state)
        Mirror(origin, mirror, "run").sync()
        for _ in range(6):
            trainer.step()
            pub.publish(trainer.state)
    collect_garbage(Run(open_store(origin), "run"), keep=2, grace=timedelta(0))
    with pytest.raises(VersionNotFound, match="garbage-collected"):
        Mirror(origin, mirror, "run").sync()
    assert assert_valid_mirror(mirror) == [1]
    assert Mirror(origin, mirror, "run", keep=2).sync().versions == [4, 5, 6, 7]
    assert assert_valid_mirror(mirror) == [4, 5, 6, 7]


def test_the_head_is_copied_only_forward(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    publish_versions(origin, "run", 5, seed=11, keyframe_every=3)
    Mirror(origin, mirror, "run").sync()
    newest = head_bytes(mirror)
    # The origin's head goes back to version 3 (its manifests 4 and 5 stay): a head is a
    # hint that readers look past; the mirror keeps its newer one.
    store = open_store(origin)
    run = Run(store, "run")
    current = run.read_head()
    assert current is not None
    from datetime import UTC, datetime

    from schemas.head import HeadV1

    old = HeadV1(run="run", version=3, manifest_digest=run.read_manifest(3).digest, updated_at=datetime.now(UTC))
    store.put_if_match(f"run/{HEAD}", old.model_dump_json().encode(), current.etag)
    assert Mirror(origin, mirror, "run").sync().head_version == 5
    assert head_bytes(mirror) == newest
    # A fresh mirror of that origin takes every version, and the head as it is.
    fresh = str(tmp_path / "fresh")
    report = Mirror(origin, fresh, "run").sync()
    assert report.versions == [1, 2, 3, 4, 5] and report.head_version == 3
    assert Run(open_store(fresh), "run").tip().version == 5  # type: ignore[union-attr]


def test_follow_copies_new_versions_and_an_idle_poll_is_one_conditional_read(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    trainer = ToyTrainer(seed=12)
    pub = Publisher(origin, "run", keyframe_every=3)
    pub.publish(trainer.state)
    counted = CountingStore(open_store(origin))
    follower = Mirror(counted, mirror, "run")
    stop = threading.Event()
    reached: list[int | None] = []
    thread = threading.Thread(
        target=lambda: reached.extend(r.to_version for r in follower.follow(interval=0.02, stop=stop))
    )
    thread.start()
    try:
        for version in (2, 3, 4):
            trainer.step()
            assert pub.publish(trainer.state) == version
            deadline = time.monotonic() + 10
            while (tip := Run(open_store(mirror), "run").tip()) is None or tip.version < version:
                assert time.monotonic() < deadline, f"version {version} was not mirrored"
                time.sleep(0.01)
        deadline = time.monotonic() + 10
        while Run(open_store(mirror), "run").read_head().head.version < 4:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        counted.reset()
        time.sleep(0.3)  # about 15 idle polls
        idle = counted.reset()
    finally:
        stop.set()
        thread.join(timeout=10)
        pub.close()
    assert not thread.is_alive()
    assert reached[-1] == 4
    assert idle.requests >= 5 and idle.down == 0 and idle.up == 0  # conditional reads of an unchanged head
    assert objects(mirror) == objects(origin)


def test_follow_reports_errors_and_goes_on(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    publish_versions(origin, "run", 2, seed=13, keyframe_every=3)
    Mirror(origin, mirror, "run").sync()
    rewrite(origin, "run", 3, seed=14)  # every pass now fails: the origin was replaced
    errors: list[Exception] = []
    stop = threading.Event()

    def on_error(exc: Exception) -> None:
        errors.append(exc)
        if len(errors) >= 3:
            stop.set()

    assert list(Mirror(origin, mirror, "run").follow(interval=0.01, stop=stop, on_error=on_error)) == []
    assert len(errors) == 3 and all(isinstance(e, ChainMismatch) for e in errors)  # tried again each time


def test_mirror_between_s3_and_a_local_directory(s3_url: str, tmp_path: Path) -> None:
    served = publish_versions(s3_url, "run", 4, seed=15, keyframe_every=3)
    local = str(tmp_path / "mirror")
    assert Mirror(s3_url, local, "run").sync().versions == [1, 2, 3, 4]
    assert assert_valid_mirror(local) == [1, 2, 3, 4]
    prefix = f"s3://{uuid.uuid4().hex[:8]}"  # another prefix of the same bucket as a second mirror
    bucket, _, query = s3_url.partition("?")
    second = f"{bucket}/{prefix[5:]}?{query}"
    assert Mirror(local, second, "run").sync().versions == [1, 2, 3, 4]
    assert assert_valid_mirror(second) == [1, 2, 3, 4]
    assert_bits_equal(_sync_node([second, s3_url]).arrays, served[-1])


class _ReadOnlySite(WrapperStore):
    """A store that cannot take writes at all (as an HTTP site), by capability."""

    @property
    def writable(self) -> bool:
        return False


def test_a_mirror_into_a_store_without_writes_is_refused_before_anything(tmp_path: Path) -> None:
    origin = str(tmp_path / "origin")
    publish_versions(origin, "run", 1, seed=16, keyframe_every=3)
    with pytest.raises(StoreNotWritable):
        Mirror(origin, _ReadOnlySite(open_store(str(tmp_path / "mirror"))), "run")
    with pytest.raises(ConfigError, match="two stores"):
        Mirror(origin, origin, "run")
    with pytest.raises(ConfigError, match="keep"):
        Mirror(origin, str(tmp_path / "mirror"), "run", keep=0)
    assert not (tmp_path / "mirror").exists()
