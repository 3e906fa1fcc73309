"""Publisher and Subscriber end to end on the memory and local-directory stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.checkpoint import Checkpoint
from bulletin.errors import (
    DigestMismatch,
    InvalidTensorName,
    UnsupportedDtype,
    VerificationFailed,
    VersionConflict,
    VersionNotFound,
)
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, LocalDirTarget
from patcher.fingerprint import fingerprint
from tests.run.helpers import ToyTrainer, assert_bits_equal


def _publish(pub: Publisher, trainer: ToyTrainer, versions: int) -> list[dict[str, np.ndarray]]:
    served = []
    for i in range(versions):
        if i:
            trainer.step()
        assert pub.publish(trainer.state) == (pub.version or 0)
        served.append(trainer.served())
    return served


def test_every_version_syncs_exactly_from_any_start(store_url: str) -> None:
    trainer = ToyTrainer()
    with Publisher(store_url, "run", keyframe_every=3) as pub:
        served = _publish(pub, trainer, 7)
        assert [r.keyframe for r in pub.results] == [True, False, False, True, False, False, True]
        assert all(r.patch_bytes > 0 for r in pub.results[1:])
    for start in range(1, 8):
        for end in range(start, 8):
            target = ArrayTarget()
            sub = Subscriber(store_url, "run", target=target)
            assert sub.sync(start) == start
            assert_bits_equal(target.arrays, served[start - 1])
            assert sub.sync(end) == end
            assert sub.current_version == end
            assert_bits_equal(target.arrays, served[end - 1])


def test_catch_up_folds_transitions_and_prefers_fewer_bytes(store_url: str) -> None:
    trainer = ToyTrainer()
    with Publisher(store_url, "run", keyframe_every=100) as pub:
        served = _publish(pub, trainer, 6)
    sub = Subscriber(store_url, "run")
    sub.sync(1)
    sub.sync()
    report = sub.stats.last_report
    assert report is not None and report.keyframe is None and report.transitions == 5
    assert_bits_equal(sub.target.arrays, served[-1])  # type: ignore[attr-defined]


def test_two_subscribers_and_a_fresh_one_mid_run(store_url: str, tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=1)
    a = Subscriber(store_url, "run", tmp_path / "a")
    b = Subscriber(store_url, "run", tmp_path / "b")
    with Publisher(store_url, "run", keyframe_every=4) as pub:
        pub.publish(trainer.state)
        a.sync()
        for _ in range(5):
            trainer.step()
            pub.publish(trainer.state)
            a.sync()
        b.sync(3)
        fresh = Subscriber(store_url, "run", tmp_path / "fresh")
        assert fresh.sync() == 6
    assert (a.current_version, b.current_version) == (6, 3)
    for sub in (a, fresh):
        target = sub.target
        assert isinstance(target, LocalDirTarget) and target.model_path is not None
        with Checkpoint(target.model_path) as ckpt:
            assert_bits_equal({n: ckpt.bits(n) for n in ckpt}, trainer.served())


def test_local_dir_survives_restart_and_continues(store_url: str, tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=2)
    with Publisher(store_url, "run", keyframe_every=10) as pub:
        _publish(pub, trainer, 3)
        Subscriber(store_url, "run", tmp_path / "node").sync()
        trainer.step()
        pub.publish(trainer.state)
    again = Subscriber(store_url, "run", tmp_path / "node")
    assert again.current_version == 3
    again.sync()
    assert again.stats.last_report is not None and again.stats.last_report.keyframe is None
    assert again.target.full_fingerprints() == {n: fingerprint(b) for n, b in trainer.served().items()}


def test_publisher_resumes_after_restart_without_a_keyframe(store_url: str) -> None:
    trainer = ToyTrainer(seed=3)
    with Publisher(store_url, "run", keyframe_every=10) as pub:
        _publish(pub, trainer, 2)
    trainer.step()
    with Publisher(store_url, "run", keyframe_every=10) as pub2:
        assert pub2.publish(trainer.state) == 3
        assert not pub2.results[0].keyframe
    target = ArrayTarget()
    Subscriber(store_url, "run", target=target).sync()
    assert_bits_equal(target.arrays, trainer.served())


def test_a_stale_trainer_gets_a_conflict_and_never_forks(store_url: str) -> None:
    trainer = ToyTrainer(seed=4)
    first = Publisher(store_url, "run")
    first.publish(trainer.state)
    second = Publisher(store_url, "run")
    trainer.step()
    assert second.publish(trainer.state) == 2
    trainer.step()
    with pytest.raises(VersionConflict):
        first.publish(trainer.state)
    run = Run(open_store(store_url), "run")
    assert run.versions() == [1, 2]
    assert run.read_manifest(2).manifest.writer == second.writer


def test_head_left_behind_by_a_crash_is_repaired_on_resume(store_url: str) -> None:
    trainer = ToyTrainer(seed=5)
    with Publisher(store_url, "run") as pub:
        _publish(pub, trainer, 2)
    run = Run(open_store(store_url), "run")
    head = run.read_head()
    assert head is not None
    # Put the head back to version 1, as if the trainer died between steps 2 and 3.
    v1 = run.read_manifest(1)
    from schemas.head import HeadV1

    old = HeadV1(run="run", version=1, manifest_digest=v1.digest, updated_at=head.head.updated_at)
    run.store.put_if_match(run.key("head.json"), old.model_dump_json().encode(), head.etag)
    assert run.tip() is not None and run.tip().version == 2  # type: ignore[union-attr]
    trainer.step()
    with Publisher(store_url, "run") as pub:
        assert pub.publish(trainer.state) == 3
    assert run.read_head().head.version == 3  # type: ignore[union-attr]


def test_background_publishing_keeps_order_and_snapshots(store_url: str) -> None:
    trainer = ToyTrainer(seed=6)
    expected = []
    with Publisher(store_url, "run", queue_size=1) as pub:
        futures = []
        for i in range(4):
            if i:
                trainer.step()
            futures.append(pub.publish_async(trainer.state))
            expected.append(trainer.served())
        pub.flush()
        assert [f.result().version for f in futures] == [1, 2, 3, 4]
    for version, bits in enumerate(expected, start=1):
        target = ArrayTarget()
        Subscriber(store_url, "run", target=target).sync(version)
        assert_bits_equal(target.arrays, bits)


def test_background_errors_surface_on_flush(store_url: str) -> None:
    trainer = ToyTrainer(seed=7)
    pub = Publisher(store_url, "run")
    pub.publish(trainer.state)
    other = Publisher(store_url, "run")
    other.publish(trainer.state)
    future = pub.publish_async(trainer.state)
    with pytest.raises(VersionConflict):
        pub.flush()
    with pytest.raises(VersionConflict):
        future.result()


def test_layout_change_is_published_as_a_keyframe(store_url: str) -> None:
    trainer = ToyTrainer(seed=8)
    with Publisher(store_url, "run", keyframe_every=100) as pub:
        pub.publish(trainer.state)
        trainer.state["model.extra.weight"] = np.ones((3, 3), np.float32)
        pub.publish(trainer.state)
        assert pub.results[1].keyframe and pub.results[1].patch_bytes == 0
    target = ArrayTarget()
    sub = Subscriber(store_url, "run", target=target)
    sub.sync(1)
    sub.sync(2)
    assert_bits_equal(target.arrays, trainer.served())


def test_torch_tensors_are_cast_like_torch_and_tied_weights_served_once(store_url: str) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(16, 8))
    state = {"embed.weight": emb, "lm_head.weight": emb, "bias": torch.randn(8), "steps": torch.arange(3)}
    with Publisher(store_url, "run") as pub:
        pub.publish(state)
    target = ArrayTarget()
    Subscriber(store_url, "run", target=target).sync()
    assert set(target.arrays) == {"embed.weight", "bias", "steps"}
    want = emb.detach().to(torch.bfloat16).view(torch.uint16).numpy()
    assert np.array_equal(target.arrays["embed.weight"], want)
    assert target.specs is not None and target.specs["steps"].dtype == "I64"


def test_bad_state_dicts_get_typed_errors(store_url: str) -> None:
    with Publisher(store_url, "run") as pub:
        with pytest.raises(InvalidTensorName):
            pub.publish({"../etc/passwd": np.zeros(3, np.float32)})
        with pytest.raises(UnsupportedDtype):
            pub.publish({"w": np.zeros(3, np.complex64)})
        assert pub.version is None
    assert Run(open_store(store_url), "run").versions() == []


def test_missing_versions_and_runs_are_typed(store_url: str) -> None:
    with pytest.raises(VersionNotFound):
        Subscriber(store_url, "nothing-here").sync()
    trainer = ToyTrainer()
    with Publisher(store_url, "run") as pub:
        pub.publish(trainer.state)
    with pytest.raises(VersionNotFound):
        Subscriber(store_url, "run").sync(5)


def test_a_corrupt_shard_is_detected_and_never_applied(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    trainer = ToyTrainer(seed=9)
    with Publisher(bucket, "run") as pub:
        served = _publish(pub, trainer, 2)
    node = Subscriber(bucket, "run", tmp_path / "node")
    node.sync(1)
    shard = next((bucket / "run" / "patches").rglob("*.bpatch"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch):
        node.sync()
    assert node.current_version == 1
    target = node.target
    assert isinstance(target, LocalDirTarget) and target.model_path is not None
    with Checkpoint(target.model_path) as ckpt:
        assert_bits_equal({n: ckpt.bits(n) for n in ckpt}, served[0])
    assert target.full_fingerprints() == {n: fingerprint(b) for n, b in served[0].items()}


def test_resume_and_fresh_sync_after_garbage_collection(store_url: str) -> None:
    from bulletin.maintenance import collect_garbage

    trainer = ToyTrainer(seed=10)
    with Publisher(store_url, "run", keyframe_every=3) as pub:
        _publish(pub, trainer, 5)  # keyframes at 1 and 4
    run = Run(open_store(store_url), "run")
    assert collect_garbage(run, keep=1).floor == 4
    assert run.versions() == [4, 5]
    trainer.step()
    with Publisher(store_url, "run", keyframe_every=3) as pub:  # walks back to keyframe 4 only
        assert pub.publish(trainer.state) == 6
    target = ArrayTarget()
    assert Subscriber(store_url, "run", target=target).sync() == 6
    assert_bits_equal(target.arrays, trainer.served())
    with pytest.raises(VersionNotFound):
        Subscriber(store_url, "run").sync(2)


def test_one_version_behind_applies_straight_from_the_shards(store_url: str) -> None:
    # In-memory targets take the shards as downloaded (patcher.apply_shards) when one
    # transition is due; a holder whose bits are not what it claims is refused and
    # left exactly as it was, on its version.
    assert ArrayTarget().supports_shards
    assert not LocalDirTarget.__new__(LocalDirTarget).supports_shards
    trainer = ToyTrainer(seed=4)
    with Publisher(store_url, "run", keyframe_every=100) as pub:
        served = _publish(pub, trainer, 3)
    target = ArrayTarget()
    sub = Subscriber(store_url, "run", target=target)
    assert sub.sync(2) == 2
    report = sub.stats.last_report
    assert report is not None and report.transitions == 1 and report.changed_elements > 0
    assert_bits_equal(target.arrays, served[1])
    name = next(n for n in served[1] if (served[1][n] != served[2][n]).any())
    changed = np.flatnonzero(served[1][name].reshape(-1) != served[2][name].reshape(-1))
    target.arrays[name].reshape(-1)[changed[0]] ^= 1  # damage bits the patch reads, behind the target's back
    before = {n: a.copy() for n, a in target.arrays.items()}
    with pytest.raises(VerificationFailed):
        sub.sync(3)
    assert sub.current_version == 2
    assert_bits_equal(target.arrays, before)
