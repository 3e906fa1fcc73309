"""No silent downgrade or chain switch: a run rolled back, rewritten or replaced is refused.

A node (or a publisher) holding version N checks, before any route, that the run's
newest version is not older than N and that the run's manifest of N is the one it
holds (its digest, kept in ``state.json`` for a folder and in memory otherwise). Only
``allow_reset`` / ``--allow-reset`` follows such a run.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.checkpoint import Checkpoint
from bulletin.cli import main
from bulletin.errors import ChainMismatch, RunRewound
from bulletin.maintenance import collect_garbage
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, LocalDirTarget
from tests.run.helpers import ToyTrainer, assert_bits_equal, publish_versions
from tests.run.rollback import rewind, rewrite

RUN = "run"


def _publish(store_url: str, versions: int, *, seed: int = 1, keyframe_every: int = 2) -> list[dict]:
    return publish_versions(store_url, RUN, versions, seed=seed, keyframe_every=keyframe_every)


def _files(node: Path) -> dict[str, np.ndarray]:
    with Checkpoint(node / LocalDirTarget.CURRENT) as ckpt:
        return {name: np.array(ckpt.bits(name)) for name in ckpt.specs}


def _sync_node(store_url: str, node: Path, version: int | None = None) -> int:
    with Subscriber(store_url, RUN, node) as sub:
        return sub.sync(version)


# -- the Python API ---------------------------------------------------------------------------


def test_the_local_state_records_the_manifest_digest(store_url: str, tmp_path: Path) -> None:
    _publish(store_url, 3)
    node = tmp_path / "node"
    assert _sync_node(store_url, node) == 3
    state = json.loads((node / LocalDirTarget.STATE).read_text())
    assert state["manifest_digest"] == Run(open_store(store_url), RUN).read_manifest(3).digest
    target = LocalDirTarget(node, run=RUN)
    try:
        held = target.restored()
    finally:
        target.close()
    assert held is not None and held.manifest_digest == state["manifest_digest"]


def test_a_rolled_back_run_is_refused_and_the_node_keeps_its_version(store_url: str, tmp_path: Path) -> None:
    served = _publish(store_url, 5)
    node = tmp_path / "node"
    assert _sync_node(store_url, node) == 5
    rewind(store_url, RUN, 3)
    with Subscriber(store_url, RUN, node) as sub:
        with pytest.raises(RunRewound, match="newest version is 3"):
            sub.sync()
        assert sub.current_version == 5
        with pytest.raises(RunRewound):  # asking for the old version explicitly is no way round it
            sub.sync(3)
        assert sub.current_version == 5
    assert_bits_equal(_files(node), served[4])
    with Subscriber(store_url, RUN, node, allow_reset=True) as sub:  # the user's explicit choice
        assert sub.sync() == 3
        assert sub.stats.resets == 1 and "rolled back" in (sub.stats.last_reset or "")
    assert_bits_equal(_files(node), served[2])


@pytest.mark.parametrize("versions", [5, 7, 3])
def test_a_rewritten_run_is_refused(store_url: str, tmp_path: Path, versions: int) -> None:
    # Another run's chain under the same name: as long as the held one (same length),
    # longer, or shorter. Today's code follows the first two and downgrades to the third.
    _publish(store_url, 5)
    node = tmp_path / "node"
    assert _sync_node(store_url, node) == 5
    before = _files(node)
    other = rewrite(store_url, RUN, versions, seed=99)
    with Subscriber(store_url, RUN, node) as sub:
        with pytest.raises(ChainMismatch) as info:
            sub.sync()
        assert isinstance(info.value, RunRewound) == (versions < 5)
        assert sub.current_version == 5
    assert_bits_equal(_files(node), before)
    with Subscriber(store_url, RUN, node, allow_reset=True) as sub:
        assert sub.sync() == versions
    assert_bits_equal(_files(node), other[-1])
    assert _sync_node(store_url, node) == versions  # and it follows the new chain from now on


def test_a_run_rolled_back_and_published_again_is_refused(store_url: str, tmp_path: Path) -> None:
    _publish(store_url, 5)
    node = tmp_path / "node"
    assert _sync_node(store_url, node) == 5
    rewind(store_url, RUN, 3)
    trainer = ToyTrainer(seed=42)
    with Publisher(store_url, RUN, keyframe_every=2) as pub:  # a new trainer resumes from 3
        for _ in range(3):
            trainer.step()
            pub.publish(trainer.state)
    with Subscriber(store_url, RUN, node) as sub, pytest.raises(ChainMismatch, match="rewritten or replaced"):
        sub.sync()  # version 6 exists, but its chain's version 5 is not the one held


def test_an_in_memory_target_keeps_the_digest_for_the_subscriber_s_lifetime(store_url: str) -> None:
    _publish(store_url, 4)
    target = ArrayTarget()
    sub = Subscriber(store_url, RUN, target=target)
    assert sub.sync() == 4
    assert sub.held is not None and sub.held.manifest_digest == target.manifest_digest is not None
    rewrite(store_url, RUN, 4, seed=7)
    with pytest.raises(ChainMismatch):
        sub.sync()
    assert sub.current_version == 4


def test_a_state_written_before_the_digest_is_checked_by_its_fingerprints(store_url: str, tmp_path: Path) -> None:
    served = _publish(store_url, 3)
    node = tmp_path / "node"
    assert _sync_node(store_url, node, 2) == 2
    state_path = node / LocalDirTarget.STATE
    state = json.loads(state_path.read_text())
    del state["manifest_digest"]  # as written by an older bulletin
    state_path.write_text(json.dumps(state))
    assert _sync_node(store_url, node) == 3  # the same chain: on it goes
    assert_bits_equal(_files(node), served[2])
    state = json.loads(state_path.read_text())
    del state["manifest_digest"]
    state_path.write_text(json.dumps(state))
    rewrite(store_url, RUN, 4, seed=5)
    with Subscriber(store_url, RUN, node) as sub, pytest.raises(ChainMismatch, match="other bits"):
        sub.sync()


def test_garbage_collection_and_chosen_downgrades_are_not_refused(store_url: str, tmp_path: Path) -> None:
    served = _publish(store_url, 8, keyframe_every=3)
    node = tmp_path / "node"
    assert _sync_node(store_url, node, 2) == 2
    collect_garbage(Run(open_store(store_url), RUN), keep=2)  # version 2 is gone: nothing to check it by
    assert _sync_node(store_url, node) == 8
    assert_bits_equal(_files(node), served[7])
    assert _sync_node(store_url, node, 7) == 7  # an older version of the same chain, asked for by name
    assert_bits_equal(_files(node), served[6])


def test_follow_reports_a_rewound_head_and_follows_it_only_when_allowed(store_url: str) -> None:
    _publish(store_url, 4)
    strict = Subscriber(store_url, RUN, target=ArrayTarget())
    lenient = Subscriber(store_url, RUN, target=ArrayTarget(), allow_reset=True)
    for sub in (strict, lenient):
        assert sub.sync() == 4
        assert sub.head_version() == 4 and not sub.head_diverged()
    rewind(store_url, RUN, 2)
    errors: list[Exception] = []
    stop = threading.Event()

    def on_error(exc: Exception) -> None:
        errors.append(exc)
        stop.set()

    assert list(strict.follow(interval=0.01, stop=stop, on_error=on_error)) == []
    assert len(errors) == 1 and isinstance(errors[0], RunRewound)
    assert strict.head_diverged() and strict.current_version == 4
    assert next(lenient.follow(interval=0.01)) == 2
    assert not lenient.head_diverged()


# -- the publisher ------------------------------------------------------------------------------


def test_a_publisher_refuses_to_continue_a_run_rolled_back_under_it(store_url: str) -> None:
    trainer = ToyTrainer(seed=3)
    pub = Publisher(store_url, RUN, keyframe_every=2)
    for i in range(5):
        if i:
            trainer.step()
        pub.publish(trainer.state)
    rewind(store_url, RUN, 3)
    trainer.step()
    with pytest.raises(RunRewound, match="a new Publisher resumes"):
        pub.publish(trainer.state)
    run = Run(open_store(store_url), RUN)
    assert run.versions() == [1, 2, 3]  # nothing committed on top of the hole
    head = run.read_head()
    assert head is not None and head.head.version == 3
    with pytest.raises(Exception):  # noqa: B017 - and it stays stopped
        pub.publish(trainer.state)
    with Publisher(store_url, RUN, keyframe_every=2) as fresh:  # a new one continues the run as it is
        assert fresh.publish(trainer.state) == 4


def test_a_publisher_refuses_a_run_rewritten_under_it(store_url: str) -> None:
    trainer = ToyTrainer(seed=3)
    pub = Publisher(store_url, RUN, keyframe_every=2)
    for i in range(3):
        if i:
            trainer.step()
        pub.publish(trainer.state)
    rewrite(store_url, RUN, 3, seed=11)
    trainer.step()
    with pytest.raises(ChainMismatch) as info:
        pub.publish(trainer.state)
    assert not isinstance(info.value, RunRewound)
    assert Run(open_store(store_url), RUN).versions() == [1, 2, 3]


# -- the command line -----------------------------------------------------------------------------


def test_bulletin_sync_refuses_a_rolled_back_run_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = str(tmp_path / "bucket")
    served = _publish(bucket, 5)
    node = tmp_path / "node"
    where = ["--store", bucket, "--run", RUN, "--to", str(node)]
    assert main(["sync", *where]) == 0
    capsys.readouterr()
    rewind(bucket, RUN, 3)
    code = main(["sync", *where])
    out, err = capsys.readouterr()
    assert code == 10, (out, err)
    assert err.startswith("error: run_rewound:") and err.count("\n") == 1
    assert_bits_equal(_files(node), served[4])

    assert main(["status", "--store", bucket, "--run", RUN, "--local", str(node), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["local_version"] == 5 and status["newest_version"] == 3
    assert status["local_chain"]["ok"] is False and status["local_chain"]["code"] == "run_rewound"

    code = main(["sync", *where, "--allow-reset", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["from_version"] == 5 and data["version"] == 3 and "rolled back" in data["reset"]
    assert_bits_equal(_files(node), served[2])
    assert main(["status", "--store", bucket, "--run", RUN, "--local", str(node), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["local_chain"]["ok"] is True


def test_bulletin_sync_refuses_a_rewritten_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = str(tmp_path / "bucket")
    _publish(bucket, 4)
    node = tmp_path / "node"
    where = ["--store", bucket, "--run", RUN, "--to", str(node)]
    assert main(["sync", *where]) == 0
    other = rewrite(bucket, RUN, 6, seed=8)
    capsys.readouterr()
    assert main(["sync", *where]) == 10
    assert capsys.readouterr().err.startswith("error: chain_mismatch:")
    assert main(["sync", *where, "--allow-reset"]) == 0
    out = capsys.readouterr().out
    assert "-> 6" in out and "reset (--allow-reset)" in out
    assert_bits_equal(_files(node), other[-1])


def test_a_run_emptied_under_a_node_is_a_rewind_not_a_fresh_run(store_url: str) -> None:
    _publish(store_url, 2)
    sub = Subscriber(store_url, RUN, target=ArrayTarget())
    assert sub.sync() == 2
    run = Run(open_store(store_url), RUN)
    for info in list(run.objects()):
        run.store.delete(info.key)
    with pytest.raises(RunRewound, match="no version left"):
        sub.sync()
    assert sub.current_version == 2
